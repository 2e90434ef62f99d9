package main

import (
	"bytes"
	"testing"
)

func TestTopicRulesFollowMQTTWildcards(t *testing.T) {
	// matches: a rule against a topic name; overlaps: a rule against a SUBSCRIBE's filter.
	cases := []struct {
		fn   func(string, string) bool
		a, b string
		want bool
	}{
		{matches, "r/ingest/+/+", "r/ingest/s/gw1", true},
		{matches, "r/ingest/+/+", "r/ingest/s", false},
		{matches, "r/results/#", "r/results/p/k", true},
		{matches, "r/results/#", "r/results", true},
		{matches, "#", "$SYS/broker/uptime", false},
		{matches, "$SYS/#", "$SYS/broker/uptime", true},
		{matches, "r/a", "r/b", false},
		{overlaps, "r/ingest/+/+", "r/ingest/+/+", true},
		{overlaps, "r/ingest/+/gw1", "r/ingest/#", true},
		{overlaps, "r/results/p", "r/results/+", true},
		{overlaps, "r/results/p", "r/shoal/+", false},
		{overlaps, "r/a/b", "r/a", false},
	}
	for i, c := range cases {
		if got := c.fn(c.a, c.b); got != c.want {
			t.Errorf("case %d (%q, %q) = %v, want %v", i, c.a, c.b, got, c.want)
		}
	}
}

// connect5 builds an MQTT 5 CONNECT body with a Will of the given payload.
func connect5(clientID, willTopic string, willPayload []byte) []byte {
	str := func(s string) []byte { return append([]byte{byte(len(s) >> 8), byte(len(s))}, s...) }
	body := append(str("MQTT"), 5, 0x04|0x02|0x20, 0, 60) // will, clean start, will retain
	body = append(body, 0)                                // no properties
	body = append(body, str(clientID)...)
	body = append(body, 0) // no will properties
	body = append(body, str(willTopic)...)
	body = append(body, byte(len(willPayload)>>8), byte(len(willPayload)))
	return append(body, willPayload...)
}

func TestAnEmptyWillPayloadIsRewrittenAndOthersAreLeftAlone(t *testing.T) {
	out, id, empty, err := rewriteConnect(connect5("c1", "r/presence", nil))
	if err != nil || id != "c1" || !empty {
		t.Fatalf("got id %q empty %v err %v", id, empty, err)
	}
	if want := connect5("c1", "r/presence", willPlaceholder); !bytes.Equal(out, want) {
		t.Fatalf("rewritten\n%v\nwant\n%v", out, want)
	}
	body := connect5("c2", "r/presence", []byte("bye"))
	out, id, empty, err = rewriteConnect(body)
	if err != nil || id != "c2" || empty || !bytes.Equal(out, body) {
		t.Fatalf("a non-empty Will changed: id %q empty %v err %v", id, empty, err)
	}
	if _, _, _, err := rewriteConnect(body[:5]); err == nil {
		t.Fatal("a truncated CONNECT was accepted")
	}
}

func TestVarintRoundTrips(t *testing.T) {
	for _, n := range []int{0, 127, 128, 16383, 16384, 2097151} {
		c := &cursor{b: varint(n)}
		if got, err := c.varint(); err != nil || got != n {
			t.Errorf("varint(%d) read back as %d (%v)", n, got, err)
		}
	}
}
