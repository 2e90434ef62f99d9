package main

// Sessions resumed and taken over, and packet identifiers of both directions, through a real
// TCP connection to shoal-mochi's server (newServer) and a minimal MQTT 5 client.

import (
	"bytes"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"sort"
	"sync"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// probeHook runs a test's function once, inside one of Mochi's windows.
type probeHook struct {
	mqtt.HookBase
	once      sync.Once
	onDropped func() // while a taken-over session's messages are cleared
	onResend  func() // while a resumed session's queue is re-sent
}

func (h *probeHook) ID() string { return "test-probe" }

func (h *probeHook) Provides(b byte) bool { return b == mqtt.OnQosDropped || b == mqtt.OnQosPublish }

func (h *probeHook) OnQosDropped(cl *mqtt.Client, _ packets.Packet) {
	if h.onDropped != nil && cl.IsTakenOver() {
		h.once.Do(h.onDropped)
	}
}

func (h *probeHook) OnQosPublish(_ *mqtt.Client, pk packets.Packet, _ int64, _ int) {
	if h.onResend != nil && pk.FixedHeader.Dup {
		h.once.Do(h.onResend)
	}
}

type broker struct {
	server *mqtt.Server
	store  *boltStore
	addr   string
}

// startBroker: newServer with a store in a temporary folder and the probe, accepting on a
// free port.
func startBroker(t *testing.T, probe *probeHook) *broker {
	t.Helper()
	return startBrokerOn(t, filepath.Join(t.TempDir(), "mochi.db"), probe)
}

// startBrokerOn: startBroker on the store file `store` (a new one, or one left behind).
func startBrokerOn(t *testing.T, store string, probe *probeHook) *broker {
	t.Helper()
	cfg := &Config{
		AllowAnonymous:       true,
		StoreFile:            store,
		MaximumInflight:      65535,
		ReceiveMaximum:       65535,
		MaximumClientWrites:  65535,
		MaximumMessageExpiry: 0,
	}
	built, err := newServer(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	server := built.server
	if err := server.AddHook(probe, nil); err != nil {
		t.Fatal(err)
	}
	if err := server.Serve(); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _ = server.EstablishConnection("t", conn) }()
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); _ = server.Close() })
	return &broker{server: server, store: built.store, addr: ln.Addr().String()}
}

// client is an MQTT 5 client: packets encoded and decoded with Mochi's own codec.
type client struct {
	t      *testing.T
	conn   net.Conn
	reader *mqtt.Client // decodes what the server sends
}

func dial(t *testing.T, addr, id string, receiveMaximum uint16) (*client, packets.Packet) {
	t.Helper()
	return dialSession(t, addr, id, receiveMaximum, 3600)
}

// dialSession: dial with a session expiry interval (0: the session ends with the connection).
func dialSession(t *testing.T, addr, id string, receiveMaximum uint16, expiry uint32) (*client, packets.Packet) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	reader := mqtt.New(nil).NewClient(conn, "", "", false)
	reader.Properties.ProtocolVersion = 5
	c := &client{t: t, conn: conn, reader: reader}
	c.send(packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect: packets.ConnectParams{
			ProtocolName:     []byte("MQTT"),
			Keepalive:        30,
			ClientIdentifier: id,
		},
		Properties: packets.Properties{
			SessionExpiryInterval:     expiry,
			SessionExpiryIntervalFlag: true,
			ReceiveMaximum:            receiveMaximum,
		},
	})
	ack := c.next()
	if ack.FixedHeader.Type != packets.Connack || ack.ReasonCode != 0 {
		t.Fatalf("CONNACK 0 expected, got %+v reason %#x", ack.FixedHeader, ack.ReasonCode)
	}
	return c, ack
}

func (c *client) send(pk packets.Packet) {
	c.t.Helper()
	pk.ProtocolVersion = 5
	buf := new(bytes.Buffer)
	var err error
	switch pk.FixedHeader.Type {
	case packets.Connect:
		err = pk.ConnectEncode(buf)
	case packets.Subscribe:
		pk.FixedHeader.Qos = 1
		err = pk.SubscribeEncode(buf)
	case packets.Unsubscribe:
		pk.FixedHeader.Qos = 1
		err = pk.UnsubscribeEncode(buf)
	case packets.Publish:
		err = pk.PublishEncode(buf)
	case packets.Puback:
		err = pk.PubackEncode(buf)
	}
	if err == nil {
		_, err = c.conn.Write(buf.Bytes())
	}
	if err != nil {
		c.t.Fatal(err)
	}
}

// next: the next packet from the server (the test fails after 5 s without one).
func (c *client) next() packets.Packet {
	c.t.Helper()
	pk, err := c.read(5 * time.Second)
	if err != nil {
		c.t.Fatal(err)
	}
	return pk
}

func (c *client) read(timeout time.Duration) (packets.Packet, error) {
	_ = c.conn.SetReadDeadline(time.Now().Add(timeout))
	fh := new(packets.FixedHeader)
	if err := c.reader.ReadFixedHeader(fh); err != nil {
		return packets.Packet{}, err
	}
	return c.reader.ReadPacket(fh)
}

// subscribe sends a SUBSCRIBE and returns its SUBACK and the messages that came first.
func (c *client) subscribe(id uint16, filter string) (packets.Packet, []packets.Packet) {
	c.send(packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Subscribe},
		PacketID:    id,
		Filters:     packets.Subscriptions{{Filter: filter, Qos: 1}},
	})
	var before []packets.Packet
	for {
		pk := c.next()
		if pk.FixedHeader.Type == packets.Suback {
			return pk, before
		}
		before = append(before, pk)
	}
}

// publishes: the payloads of the PUBLISH packets that arrive within `quiet` of each other.
func (c *client) publishes(quiet time.Duration) []string {
	var got []string
	for {
		pk, err := c.read(quiet)
		if err != nil {
			return got
		}
		if pk.FixedHeader.Type == packets.Publish {
			got = append(got, string(pk.Payload))
		}
	}
}

func publish(t *testing.T, server *mqtt.Server, topic string, payloads ...string) {
	t.Helper()
	for _, p := range payloads {
		if err := server.Publish(topic, []byte(p), false, 1); err != nil {
			t.Fatal(err)
		}
	}
}

// dropConnection closes the client's connection and waits until the server has seen it.
func (b *broker) dropConnection(t *testing.T, c *client, id string) {
	t.Helper()
	_ = c.conn.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if cl, ok := b.server.Clients.Get(id); ok && cl.Closed() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the server did not see the connection close")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func storedTopics(t *testing.T, store *boltStore, clientID string) []string {
	t.Helper()
	messages, err := store.StoredInflightMessages()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range messages {
		if m.Client == clientID && m.FixedHeader.Type == packets.Publish {
			got = append(got, string(m.Payload))
		}
	}
	sort.Strings(got)
	return got
}

func sorted(s []string) []string {
	out := append([]string(nil), s...)
	sort.Strings(out)
	return out
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestAMessageDealtDuringATakeoverReachesTheNewSession(t *testing.T) {
	// Mochi clears the old session after copying its queue and before registering the new
	// one: a message dealt in between was stored in the old session only (takeover.go).
	probe := new(probeHook)
	b := startBroker(t, probe)
	probe.onDropped = func() { publish(t, b.server, "t/w", "window") }
	first, _ := dial(t, b.addr, "a", 0)
	if ack, _ := first.subscribe(1, "$share/g/t/#"); ack.ReasonCodes[0] != 1 {
		t.Fatalf("SUBACK %v", ack.ReasonCodes)
	}
	publish(t, b.server, "t/q", "q1", "q2", "q3")
	if got := first.publishes(300 * time.Millisecond); len(got) != 3 {
		t.Fatalf("first connection got %v", got) // and acknowledges none
	}
	b.dropConnection(t, first, "a")

	second, ack := dial(t, b.addr, "a", 0)
	if !ack.SessionPresent {
		t.Fatal("the session was not resumed")
	}
	got := sorted(second.publishes(500 * time.Millisecond))
	if want := []string{"q1", "q2", "q3", "window"}; !equal(got, want) {
		t.Fatalf("the resumed session got %v, want %v", got, want)
	}
	// Its store holds the same four (Mochi's clearing deleted the three copied ones).
	if got := storedTopics(t, b.store, "a"); !equal(got, []string{"q1", "q2", "q3", "window"}) {
		t.Fatalf("stored for the resumed session: %v", got)
	}
}

func TestMessagesDealtWhileAQueueIsResentAreSentDespiteAReceiveMaximum(t *testing.T) {
	// A client with Receive Maximum 1: messages dealt to it while its queue was re-sent
	// were parked for its send quota and never sent (main.go, flowHook).
	probe := new(probeHook)
	b := startBroker(t, probe)
	probe.onResend = func() { publish(t, b.server, "t/n", "n1", "n2", "n3") }
	first, _ := dial(t, b.addr, "w", 1)
	first.subscribe(1, "t/#")
	publish(t, b.server, "t/q", "q1")
	if got := first.publishes(300 * time.Millisecond); len(got) != 1 {
		t.Fatalf("first connection got %v", got)
	}
	b.dropConnection(t, first, "w")
	second, _ := dial(t, b.addr, "w", 1)
	got := sorted(second.publishes(500 * time.Millisecond))
	if want := []string{"n1", "n2", "n3", "q1"}; !equal(got, want) {
		t.Fatalf("the resumed session got %v, want %v", got, want)
	}
}

func TestPacketIdentifiersOfTheTwoDirectionsDoNotCollide(t *testing.T) {
	b := startBroker(t, new(probeHook))
	c, _ := dial(t, b.addr, "c", 0)
	c.subscribe(1, "t/#")
	publish(t, b.server, "t/x", "held")
	held := c.next()
	if held.FixedHeader.Type != packets.Publish || held.PacketID == 0 {
		t.Fatalf("expected a QoS 1 PUBLISH, got %+v", held)
	}
	id := held.PacketID // not acknowledged

	// A SUBSCRIBE with that identifier: granted (Mochi refused it 0x91), and the SUBACK
	// carries the client's identifier.
	ack, _ := c.subscribe(id, "v/#")
	if ack.PacketID != id || ack.ReasonCodes[0] != 1 {
		t.Fatalf("SUBACK id %d codes %v, want id %d granted", ack.PacketID, ack.ReasonCodes, id)
	}
	// A QoS 1 PUBLISH with that identifier: acknowledged, and the held message stays held
	// (Mochi deleted it, and its store record).
	c.send(packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1},
		PacketID:    id,
		TopicName:   "u/y",
		Payload:     []byte("up"),
	})
	if pk := c.next(); pk.FixedHeader.Type != packets.Puback || pk.PacketID != id {
		t.Fatalf("expected PUBACK %d, got %+v", id, pk)
	}
	// The PUBACK can reach the client before the broker's goroutine that wrote it has put
	// the held message back (OnQosComplete runs after the write): wait for it, bounded.
	cl, _ := b.server.Clients.Get("c")
	if m, ok := heldEventually(cl, id, time.Second); !ok || string(m.Payload) != "held" {
		t.Fatalf("held message after the client's PUBLISH: %v %q", ok, m.Payload)
	}
	if got := storedTopics(t, b.store, "c"); !equal(got, []string{"held"}) {
		t.Fatalf("stored: %v", got)
	}
	// So a reconnect gets it again.
	b.dropConnection(t, c, "c")
	again, _ := dial(t, b.addr, "c", 0)
	if got := again.publishes(500 * time.Millisecond); !equal(got, []string{"held"}) {
		t.Fatalf("after a reconnect: %v", got)
	}
}

func TestAMultiLevelWildcardAfterAPlusMatchesItsParentLevel(t *testing.T) {
	// "s/+/+/#" must match "s/a/b" (MQTT 4.7.1.2); Mochi 2.7.9 skipped it (wildcard.go).
	b := startBroker(t, new(probeHook))
	c, _ := dial(t, b.addr, "sp", 0)
	ack, _ := c.subscribe(1, "s/+/+/#")
	if len(ack.ReasonCodes) != 1 || ack.ReasonCodes[0] != 1 {
		t.Fatalf("SUBACK codes %v, want [1]", ack.ReasonCodes)
	}
	publish(t, b.server, "s/n/NBIRTH", "node")
	publish(t, b.server, "s/n/DBIRTH/d", "device")
	publish(t, b.server, "s/n", "too short")
	if got := c.publishes(300 * time.Millisecond); !equal(got, []string{"node", "device"}) {
		t.Fatalf("got %v, want each of node and device once", got)
	}
	shared, _ := dial(t, b.addr, "sh", 0)
	shared.subscribe(1, "$share/g/s/+/#")
	publish(t, b.server, "s/m", "parent")
	if got := shared.publishes(300 * time.Millisecond); !equal(got, []string{"parent"}) {
		t.Fatalf("shared member got %v", got)
	}
	c.publishes(100 * time.Millisecond)
	c.send(packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Unsubscribe},
		PacketID:    100, // not one of the unacknowledged messages' (Mochi refuses that, 0x91)
		Filters:     packets.Subscriptions{{Filter: "s/+/+/#"}},
	})
	if pk := c.next(); pk.FixedHeader.Type != packets.Unsuback || len(pk.ReasonCodes) != 1 || pk.ReasonCodes[0] != 0 {
		t.Fatalf("UNSUBACK expected with one code, got %+v %v", pk.FixedHeader, pk.ReasonCodes)
	}
	publish(t, b.server, "s/n/NBIRTH", "after")
	if got := c.publishes(300 * time.Millisecond); len(got) != 0 {
		t.Fatalf("after UNSUBSCRIBE: %v", got)
	}
}

// heldEventually: the message Mochi holds for the client under `id` once it is a PUBLISH
// again, polling for at most `wait`; the last entry seen and false if it never became one.
func heldEventually(cl *mqtt.Client, id uint16, wait time.Duration) (packets.Packet, bool) {
	deadline := time.Now().Add(wait)
	for {
		if m, ok := heldFor(cl, id); ok {
			return m, true
		}
		if time.Now().After(deadline) {
			m, _ := cl.State.Inflight.Get(id)
			return m, false
		}
		time.Sleep(time.Millisecond)
	}
}
