package main

import (
	"bytes"
	"log/slog"
	"path/filepath"
	"testing"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/hooks/storage/bolt"
	"github.com/mochi-mqtt/server/v2/packets"
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

func TestRestoredInflightMessagesKeepTheirPacketIdentifiers(t *testing.T) {
	// Mochi 2.7.9's bolt hook stores in-flight messages without their packet id; a resumed
	// session could then never be resent its queue (store.go).
	path := filepath.Join(t.TempDir(), "mochi.db")
	server := mqtt.New(nil)
	cl := server.NewClient(nil, "t", "shoal:combiner-0", false)
	store := new(boltStore)
	store.SetOpts(slog.Default(), nil)
	if err := store.Init(&bolt.Options{Path: path}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []uint16{7, 65535} {
		pk := packets.Packet{
			FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1},
			PacketID:    id,
			TopicName:   "r/partials/p/0",
			Payload:     []byte("partial"),
		}
		store.OnQosPublish(cl, pk, 0, 0)
	}
	got, err := store.StoredInflightMessages()
	if err != nil || len(got) != 2 {
		t.Fatalf("stored %d messages (%v)", len(got), err)
	}
	ids := map[uint16]bool{}
	for _, m := range got {
		ids[m.ToPacket().PacketID] = true
	}
	if !ids[7] || !ids[65535] {
		t.Fatalf("packet ids restored as %v", ids)
	}
	dup := packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1, Dup: true},
		PacketID:    8,
		TopicName:   "r/partials/p/0",
	}
	store.OnQosPublish(cl, dup, 0, 0) // a re-send: never a new record
	if again, _ := store.StoredInflightMessages(); len(again) != 2 {
		t.Fatalf("a re-send was stored: %d messages", len(again))
	}
	if packetIDFromKey("IFM_c") != 0 || packetIDFromKey("IFM_c:70000") != 0 {
		t.Fatal("a key without a valid packet id gave one")
	}
	if err := store.Stop(); err != nil {
		t.Fatal(err)
	}
}
