package main

// Mochi 2.7.9 defects shoal's tests ran into, each worked around here (docs/brokers.md).
//
// boltStore: the bolt storage hook writes a session's in-flight QoS 1 messages without their
// packet identifier (OnQosPublish leaves storage.Message.PacketID zero; only the record's key,
// "IFM_<client>:<id>", names it). After a broker restart every restored message has packet id
// 0, and resending it on the client's reconnect fails ("resend inflight: protocol violation:
// missing packet id"): Mochi closes the connection right after CONNACK, on every reconnect,
// for as long as the session lasts. A combiner (persistent session) never got its queue
// back; `shoal bench chaos` stalled after its broker restart. boltStore reads the identifier
// back from the key when the store is loaded.
//
// boltStore also leaves alone the records of a session that was taken over (takeover.go: its
// successor has the same client id, so the same keys, and holds the same messages), and does
// not store Mochi's acknowledgement of a QoS 1 message a client publishes: Mochi puts it in
// the client's in-flight map under the client's packet id for the time it takes to write
// it, and the bolt hook wrote and deleted a record for it, under the same key as a message
// Mochi holds *for* the client with that id (packet ids are per direction, [MQTT-2.2.1-3]):
// a worker or combiner publishing with packet id 7 deleted the record of the message it was
// sent as 7 and had not acknowledged yet. (Two bolt transactions per message received, too.)
//
// sysWriteHook: Mochi drops a client's PUBLISH to a $SYS topic before any hook or
// acknowledgement (MQTT 4.7.2 lets a server keep clients from $SYS), so a QoS 1 or 2 publisher
// waits for a PUBACK or PUBREC that never comes ([MQTT-4.3.2-4], [MQTT-4.3.3-8]). The hook
// answers it as Mosquitto does, "not authorized" (0x87), before Mochi drops the message.

import (
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/hooks/storage"
	"github.com/mochi-mqtt/server/v2/hooks/storage/bolt"
	"github.com/mochi-mqtt/server/v2/packets"
)

// boltStore is Mochi's bolt storage hook with the in-flight packet identifiers restored, and
// only the records of restored sessions loaded (sessions.go).
type boltStore struct {
	bolt.Hook
	// restored: whether the server restored the session of a client id. Mochi loads the
	// stored clients before their subscriptions and in-flight messages, so the server's
	// clients answer it (newServer sets it; nil: every record is loaded).
	restored func(clientID string) bool
	started  atomic.Bool  // the store is loaded: records are read as they are from then on
	orphans  atomic.Int64 // records of ended sessions not loaded (and deleted) at start-up
}

// Provides: bolt's events, and OnStarted (the store is loaded).
func (h *boltStore) Provides(b byte) bool { return b == mqtt.OnStarted || h.Hook.Provides(b) }

// OnStarted: Mochi has loaded the store.
func (h *boltStore) OnStarted() { h.started.Store(true) }

// OnQosPublish stores a message sent for the first time. Mochi calls it again for every
// message it re-sends to a reconnecting session (DUP set), rewriting the same record (its
// payload JSON-encoded) before the session can go on: for a combiner with a large queue on a
// busy machine that took longer than the client waits, and it reconnected in a loop.
func (h *boltStore) OnQosPublish(cl *mqtt.Client, pk packets.Packet, sent int64, resends int) {
	if pk.FixedHeader.Type == packets.Publish && pk.FixedHeader.Dup {
		return // already stored under the same key
	}
	if cl.IsTakenOver() || isInboundAck(pk) {
		return
	}
	h.Hook.OnQosPublish(cl, pk, sent, resends)
}

// OnQosComplete deletes the record of a message the client acknowledged, except for a
// taken-over session (its successor re-sends the message and deletes the record once
// acknowledged) and for Mochi's own acknowledgements, which are not stored.
func (h *boltStore) OnQosComplete(cl *mqtt.Client, pk packets.Packet) {
	if cl.IsTakenOver() || isInboundAck(pk) {
		return
	}
	h.Hook.OnQosComplete(cl, pk)
}

// OnQosDropped: Mochi clears a taken-over session's messages after copying them to its
// successor; their records are the successor's.
func (h *boltStore) OnQosDropped(cl *mqtt.Client, pk packets.Packet) {
	if cl.IsTakenOver() {
		return
	}
	h.Hook.OnQosComplete(cl, pk)
}

// isInboundAck: Mochi's PUBACK for a QoS 1 message a client published (built with a creation
// time; a PUBACK the client sends has none).
func isInboundAck(pk packets.Packet) bool {
	return pk.FixedHeader.Type == packets.Puback && pk.Created != 0
}

// StoredInflightMessages returns the stored in-flight messages of the restored sessions,
// each with its packet id.
func (h *boltStore) StoredInflightMessages() ([]storage.Message, error) {
	messages, err := h.Hook.StoredInflightMessages()
	for i := range messages {
		if messages[i].PacketID == 0 {
			messages[i].PacketID = packetIDFromKey(messages[i].ID)
		}
	}
	if err != nil {
		return messages, err
	}
	return h.storedInflightOfRestored(messages), nil
}

// packetIDFromKey reads the packet id at the end of an in-flight record's key
// ("IFM_<client id>:<packet id>"; a client id may itself contain ':'); 0 if there is none.
func packetIDFromKey(key string) uint16 {
	id, err := strconv.ParseUint(key[strings.LastIndexByte(key, ':')+1:], 10, 16)
	if err != nil {
		return 0
	}
	return uint16(id)
}

// sysWriteHook answers a client's QoS 1/2 PUBLISH to $SYS with "not authorized".
type sysWriteHook struct {
	mqtt.HookBase
}

func (h *sysWriteHook) ID() string { return "shoal-sys-write" }

func (h *sysWriteHook) Provides(b byte) bool { return b == mqtt.OnPacketRead }

func (h *sysWriteHook) OnPacketRead(cl *mqtt.Client, pk packets.Packet) (packets.Packet, error) {
	if pk.FixedHeader.Type != packets.Publish || pk.FixedHeader.Qos == 0 || cl.Net.Inline ||
		!isSysTopic(pk.TopicName) {
		return pk, nil
	}
	ack := packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Puback},
		PacketID:    pk.PacketID,
		ReasonCode:  packets.ErrNotAuthorized.Code,
	}
	if pk.FixedHeader.Qos == 2 {
		ack.FixedHeader.Type = packets.Pubrec // a failure code ends the QoS 2 exchange
	}
	// Mochi then drops the packet as before (an error here would end the connection).
	_ = cl.WritePacket(ack)
	return pk, nil
}

// isSysTopic: Mochi's own test for a $SYS topic name (case-insensitive prefix).
func isSysTopic(topic string) bool {
	return len(topic) >= len(mqtt.SysPrefix) && strings.EqualFold(topic[:len(mqtt.SysPrefix)], mqtt.SysPrefix)
}

// packetIDHook: Mochi 2.7.9 keeps the packet identifiers of both directions in one map per
// client, but packet identifiers are per direction in MQTT ([MQTT-2.2.1-3]): a client cannot
// know which ones the server uses for the messages it sends the client.
//
// SUBSCRIBE: Mochi refuses one whose identifier equals that of a QoS 1 message it holds *for*
// the client ("packet identifier in use", 0x91). A session resumed with queued messages then
// had SUBSCRIBE after SUBSCRIBE refused (shoal's sessions retry three times; a queue of 50
// takes up to 50 tries): the adapter and the combiners reconnected in a loop. The hook lets
// Mochi check identifier 0 instead (never in the map: Mochi numbers from 1 and a PUBLISH or
// SUBSCRIBE with 0 is refused before) and puts the client's identifier back in the SUBACK.
// (An earlier version took the held message out of the map for the check; a message sent to
// the client meanwhile could take its identifier, and the held one was lost.)
//
// PUBLISH: for a QoS 1 message the client publishes, Mochi deletes whatever the map holds
// under its identifier, the message Mochi sent the client as that identifier included: still
// delivered, but not sent again if the client reconnects before acknowledging it (a worker or
// combiner killed before its PUBACK did not get it back). The hook notes the held message
// before Mochi reads the PUBLISH and puts it back once Mochi's acknowledgement has left the
// map (the store record stays: boltStore does not store Mochi's acknowledgement). UNSUBSCRIBE keeps Mochi's check: shoal
// sends one only when it leaves a group.
type packetIDHook struct {
	mqtt.HookBase
	server    *mqtt.Server
	mu        sync.Mutex
	subscribe map[*mqtt.Client]uint16         // SUBSCRIBE checked as 0: the client's identifier
	held      map[*mqtt.Client]packets.Packet // held for the client under a PUBLISH's identifier
	restored  atomic.Int64
}

func newPacketIDHook(server *mqtt.Server) *packetIDHook {
	return &packetIDHook{
		server:    server,
		subscribe: make(map[*mqtt.Client]uint16),
		held:      make(map[*mqtt.Client]packets.Packet),
	}
}

func (h *packetIDHook) ID() string { return "shoal-packet-ids" }

func (h *packetIDHook) Provides(b byte) bool {
	switch b {
	case mqtt.OnSubscribe, mqtt.OnPacketEncode, mqtt.OnPacketRead, mqtt.OnQosComplete,
		mqtt.OnPacketProcessed, mqtt.OnDisconnect:
		return true
	}
	return false
}

// heldFor: the QoS 1/2 message Mochi holds for the client under packet id `id`, if any (an
// acknowledgement in the map is the client's own direction: a true "in use").
func heldFor(cl *mqtt.Client, id uint16) (packets.Packet, bool) {
	held, ok := cl.State.Inflight.Get(id)
	return held, ok && held.FixedHeader.Type == packets.Publish
}

func (h *packetIDHook) OnSubscribe(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	if _, ok := heldFor(cl, pk.PacketID); !ok || cl.Net.Inline {
		return pk
	}
	h.mu.Lock()
	h.subscribe[cl] = pk.PacketID
	h.mu.Unlock()
	pk.PacketID = 0
	return pk
}

func (h *packetIDHook) OnPacketEncode(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	if pk.FixedHeader.Type != packets.Suback || pk.PacketID != 0 {
		return pk
	}
	h.mu.Lock()
	id, ok := h.subscribe[cl]
	delete(h.subscribe, cl)
	h.mu.Unlock()
	if ok {
		pk.PacketID = id
	}
	return pk
}

func (h *packetIDHook) OnPacketRead(cl *mqtt.Client, pk packets.Packet) (packets.Packet, error) {
	if pk.FixedHeader.Type != packets.Publish || pk.FixedHeader.Qos == 0 || cl.Net.Inline {
		return pk, nil
	}
	if held, ok := heldFor(cl, pk.PacketID); ok {
		h.mu.Lock()
		h.held[cl] = held
		h.mu.Unlock()
	}
	return pk, nil
}

// OnQosComplete: Mochi deleted its acknowledgement of the PUBLISH (written): the held message
// goes back at once (Mochi's acknowledgement occupied its identifier until now, so no
// message sent meanwhile could take it).
func (h *packetIDHook) OnQosComplete(cl *mqtt.Client, pk packets.Packet) {
	if isInboundAck(pk) {
		h.restore(cl)
	}
}

// OnPacketProcessed: for a PUBLISH that ended before its acknowledgement.
func (h *packetIDHook) OnPacketProcessed(cl *mqtt.Client, pk packets.Packet, _ error) {
	if pk.FixedHeader.Type == packets.Publish {
		h.restore(cl)
	}
}

// OnDisconnect: a PUBLISH Mochi refused before processing it ends the connection without
// OnPacketProcessed; the held message goes back (the session may be resumed).
func (h *packetIDHook) OnDisconnect(cl *mqtt.Client, _ error, _ bool) {
	h.restore(cl)
	h.mu.Lock()
	delete(h.subscribe, cl)
	h.mu.Unlock()
}

func (h *packetIDHook) restore(cl *mqtt.Client) {
	h.mu.Lock()
	held, ok := h.held[cl]
	delete(h.held, cl)
	h.mu.Unlock()
	if !ok {
		return
	}
	if now, taken := cl.State.Inflight.Get(held.PacketID); taken {
		if now.FixedHeader.Type != packets.Publish || now.Created != held.Created {
			// A message sent to the client took the identifier in the moment it was free
			// (between Mochi's deleting the held message and its acknowledgement taking the
			// identifier): the held one was delivered but would not be sent again on a
			// reconnect.
			h.Log.Warn("held message displaced", "client", cl.ID, "packet_id", held.PacketID)
		}
		return
	}
	if cl.State.Inflight.Set(held) {
		atomic.AddInt64(&h.server.Info.Inflight, 1)
		h.restored.Add(1)
	}
}
