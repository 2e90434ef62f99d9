package main

// Session takeover. When a client reconnects with clean start 0, Mochi 2.7.9 (server.go,
// inheritClientSession) marks the old session taken over, copies its in-flight messages to
// the new one, moves its subscriptions and clears the old session's messages, and only then
// (in attachClient) registers the new client under the client id. Until then the server's
// client map still names the old session, so every message dealt to that client id in
// between is stored in the old session, which nobody reads again: lost. Clearing calls
// OnQosDropped for every copied message, and the bolt store deleted each one's record (a
// transaction apiece): with a queue of a few thousand messages on a loaded machine the window
// lasted tens of milliseconds, and a kill -9'd adapter sharing a group lost 21-199 device
// messages on its return (tests/integration/test_adapter_live.py). The records belong to the
// new session too (same client id, same packet ids), so after a broker restart its queue
// was gone as well.
//
// takeoverHook moves every message dealt to a taken-over session to its successor: held
// until the successor's session is established (after its queue was re-sent), then given a
// packet id of the successor's and sent. boltStore leaves a taken-over session's records
// alone (store.go).

import (
	"sync"
	"sync/atomic"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

type takeoverHook struct {
	mqtt.HookBase
	server   *mqtt.Server
	store    *boltStore // nil without persistence
	mu       sync.Mutex
	current  map[string]*mqtt.Client     // client id -> its latest established session
	stranded map[string][]packets.Packet // dealt to a taken-over session, successor not ready
	moved    atomic.Int64
}

func newTakeoverHook(server *mqtt.Server, store *boltStore) *takeoverHook {
	return &takeoverHook{
		server:   server,
		store:    store,
		current:  make(map[string]*mqtt.Client),
		stranded: make(map[string][]packets.Packet),
	}
}

func (h *takeoverHook) ID() string { return "shoal-takeover" }

func (h *takeoverHook) Provides(b byte) bool {
	return b == mqtt.OnQosPublish || b == mqtt.OnSessionEstablished || b == mqtt.OnDisconnect
}

// OnQosPublish sees every QoS 1/2 message Mochi puts in a session's store. One put in a
// taken-over session is taken out again and goes to the successor.
func (h *takeoverHook) OnQosPublish(cl *mqtt.Client, pk packets.Packet, _ int64, _ int) {
	if !cl.IsTakenOver() || pk.FixedHeader.Type != packets.Publish || pk.FixedHeader.Dup {
		return
	}
	if cl.State.Inflight.Delete(pk.PacketID) {
		atomic.AddInt64(&h.server.Info.Inflight, -1)
	}
	h.mu.Lock()
	successor := h.current[cl.ID]
	if successor == nil || successor == cl || successor.IsTakenOver() {
		h.stranded[cl.ID] = append(h.stranded[cl.ID], pk)
		successor = nil
	}
	h.mu.Unlock()
	if successor != nil {
		h.deliver(successor, pk)
	}
}

// OnSessionEstablished: the session's queue has been re-sent; what was stranded follows.
func (h *takeoverHook) OnSessionEstablished(cl *mqtt.Client, pk packets.Packet) {
	h.mu.Lock()
	h.current[cl.ID] = cl
	stranded := h.stranded[cl.ID]
	delete(h.stranded, cl.ID)
	h.mu.Unlock()
	if pk.Connect.Clean {
		return // a clean start discards the old session, and what was dealt to it
	}
	for _, m := range stranded {
		if copied, ok := cl.State.Inflight.Get(m.PacketID); ok && copied.Created == m.Created &&
			copied.TopicName == m.TopicName {
			// Dealt just before the copy, so copied (and re-sent) already; the store skipped
			// it for the taken-over session.
			h.storeRecord(cl, copied)
			continue
		}
		h.deliver(cl, m)
	}
}

// OnDisconnect forgets a session that ends for good.
func (h *takeoverHook) OnDisconnect(cl *mqtt.Client, _ error, expire bool) {
	if !expire || cl.IsTakenOver() {
		return
	}
	h.mu.Lock()
	if h.current[cl.ID] == cl {
		delete(h.current, cl.ID)
	}
	h.mu.Unlock()
}

// deliver gives the message one of the session's packet ids, keeps it in its store and sends
// it (a closed session keeps it for its next connection).
func (h *takeoverHook) deliver(cl *mqtt.Client, pk packets.Packet) {
	id, err := cl.NextPacketID()
	if err != nil {
		atomic.AddInt64(&h.server.Info.InflightDropped, 1)
		h.Log.Warn("taken-over message dropped: packet ids exhausted", "client", cl.ID)
		return
	}
	out := pk
	out.PacketID = uint16(id)
	out.FixedHeader.Dup = false
	if out.Expiry < 0 {
		out.Expiry = 0 // parked for the old session's send quota; this one has none
	}
	if cl.State.Inflight.Set(out) {
		atomic.AddInt64(&h.server.Info.Inflight, 1)
	}
	h.storeRecord(cl, out)
	h.moved.Add(1)
	h.Log.Warn("message dealt to a taken-over session moved to its successor",
		"client", cl.ID, "packet_id", out.PacketID, "topic", out.TopicName)
	_ = cl.WritePacket(out)
}

func (h *takeoverHook) storeRecord(cl *mqtt.Client, pk packets.Packet) {
	if h.store != nil {
		h.store.Hook.OnQosPublish(cl, pk, pk.Created, 0)
	}
}
