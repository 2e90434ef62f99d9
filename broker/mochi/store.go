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
// sysWriteHook: Mochi drops a client's PUBLISH to a $SYS topic before any hook or
// acknowledgement (MQTT 4.7.2 lets a server keep clients from $SYS), so a QoS 1 or 2 publisher
// waits for a PUBACK or PUBREC that never comes ([MQTT-4.3.2-4], [MQTT-4.3.3-8]). The hook
// answers it as Mosquitto does, "not authorized" (0x87), before Mochi drops the message.

import (
	"strconv"
	"strings"
	"sync"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/hooks/storage"
	"github.com/mochi-mqtt/server/v2/hooks/storage/bolt"
	"github.com/mochi-mqtt/server/v2/packets"
)

// boltStore is Mochi's bolt storage hook with the in-flight packet identifiers restored.
type boltStore struct {
	bolt.Hook
}

// OnQosPublish stores a message sent for the first time. Mochi calls it again for every
// message it re-sends to a reconnecting session (DUP set), rewriting the same record (its
// payload JSON-encoded) before the session can go on: for a combiner with a large queue on a
// busy machine that took longer than the client waits, and it reconnected in a loop.
func (h *boltStore) OnQosPublish(cl *mqtt.Client, pk packets.Packet, sent int64, resends int) {
	if pk.FixedHeader.Type == packets.Publish && pk.FixedHeader.Dup {
		return // already stored under the same key
	}
	h.Hook.OnQosPublish(cl, pk, sent, resends)
}

// StoredInflightMessages returns the stored in-flight messages, each with its packet id.
func (h *boltStore) StoredInflightMessages() ([]storage.Message, error) {
	messages, err := h.Hook.StoredInflightMessages()
	for i := range messages {
		if messages[i].PacketID == 0 {
			messages[i].PacketID = packetIDFromKey(messages[i].ID)
		}
	}
	return messages, err
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

// packetIDHook: Mochi 2.7.9 refuses a SUBSCRIBE whose packet identifier equals that of a
// QoS 1 message it holds *for* the client ("packet identifier in use", 0x91), but packet
// identifiers are per direction in MQTT ([MQTT-2.2.1-3]): a client cannot know which ones the
// server uses. A session resumed with queued messages then had SUBSCRIBE after SUBSCRIBE
// refused (shoal's sessions retry three times; a queue of 50 takes up to 50 tries): the
// adapter and the combiners reconnected in a loop. The hook sets the held message aside for
// the SUBSCRIBE's check and puts it back as soon as the SUBACK is decided, in the same
// goroutine (nothing else reads the client's packets meanwhile; the store is not touched).
type packetIDHook struct {
	mqtt.HookBase
	mu   sync.Mutex
	held map[string]packets.Packet
}

func (h *packetIDHook) ID() string { return "shoal-packet-ids" }

func (h *packetIDHook) Provides(b byte) bool {
	return b == mqtt.OnSubscribe || b == mqtt.OnSubscribed
}

func (h *packetIDHook) OnSubscribe(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	held, ok := cl.State.Inflight.Get(pk.PacketID)
	if !ok || held.FixedHeader.Type != packets.Publish {
		return pk // free, or an inbound QoS 2 exchange: the same direction, a true 0x91
	}
	cl.State.Inflight.Delete(pk.PacketID)
	h.mu.Lock()
	h.held[cl.ID] = held
	h.mu.Unlock()
	return pk
}

func (h *packetIDHook) OnSubscribed(cl *mqtt.Client, _ packets.Packet, _ []byte) {
	h.mu.Lock()
	held, ok := h.held[cl.ID]
	delete(h.held, cl.ID)
	h.mu.Unlock()
	if !ok {
		return
	}
	if _, taken := cl.State.Inflight.Get(held.PacketID); taken {
		// A new message took the identifier meanwhile (only after 65,535 others): the held
		// one stays in the store and comes back after a broker restart.
		h.Log.Warn("held message displaced", "client", cl.ID, "packet_id", held.PacketID)
		return
	}
	cl.State.Inflight.Set(held)
}
