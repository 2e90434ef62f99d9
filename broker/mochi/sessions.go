package main

// Sessions that ended must leave their subscriptions, on a restart and on expiry.
//
// Mochi 2.7.9 deals each message of a shared group to one member it picks from the topic
// index, and sends it only if a client with that id exists (publishToSubscribers): a message
// dealt to a subscription without a client is dropped, with no log and no counter. Two paths
// left such subscriptions in the index:
//
//   - Restart. Mochi loads the stored clients first and drops those whose session ends with
//     the connection (session expiry 0: shoal's workers, gateways, output sessions), by
//     unsubscribing their (still empty) subscription list; only then does it load the stored
//     subscriptions, every one of them, for clients that no longer exist. A broker killed
//     while such clients were connected (its store still held their subscriptions) came back
//     with the dead workers as members of the workers' shared group, and dealt them their
//     share of every gateway's batches (test_faults.py's SIGTERM-while-the-broker-is-down
//     test: 3 dead and 3 live workers, so about half of what the gateways sent after the
//     restart was dropped; gateway gw0's last batches then went unconfirmed through 188
//     re-sends). The records stayed in the store, so every later restart brought them back.
//   - Expiry. When a disconnected persistent session expires, Mochi deletes the client but
//     leaves its subscriptions in the index (and its messages' records in the store): an
//     adapter sharing device messages with a persistent session that expired kept its share
//     of them, dropped.
//
// boltStore (store.go) restores only the subscriptions and in-flight messages of sessions
// the server restored and deletes the others' records; expiryHook unsubscribes an expired
// session and drops its messages, as Mochi does for a session that ends on disconnect.

import (
	"sync/atomic"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/hooks/storage"
	"github.com/mochi-mqtt/server/v2/packets"
)

// restoredOnly keeps the records whose session the server restored (`restored(client id)`)
// and deletes the others with `drop`; how many were dropped goes to `dropped`.
func restoredOnly[T any](records []T, client func(T) string, restored func(string) bool,
	drop func(T), dropped *atomic.Int64) []T {
	if restored == nil {
		return records
	}
	kept := records[:0]
	for _, r := range records {
		if restored(client(r)) {
			kept = append(kept, r)
			continue
		}
		drop(r)
		dropped.Add(1)
	}
	return kept
}

// loading: whether a client id's session was restored, while the server loads the store
// (nil once it is loaded: the records are then read as they are, nothing is deleted).
func (h *boltStore) loading() func(string) bool {
	if h.started.Load() {
		return nil
	}
	return h.restored
}

// StoredSubscriptions returns the stored subscriptions of the sessions the server restored
// and deletes the records of the others (their sessions ended: see the top of this file).
func (h *boltStore) StoredSubscriptions() ([]storage.Subscription, error) {
	subs, err := h.Hook.StoredSubscriptions()
	if err != nil {
		return subs, err
	}
	before := h.orphans.Load()
	subs = restoredOnly(subs, func(s storage.Subscription) string { return s.Client }, h.loading(),
		func(s storage.Subscription) {
			gone := packets.Packet{Filters: packets.Subscriptions{{Filter: s.Filter}}}
			h.Hook.OnUnsubscribed(&mqtt.Client{ID: s.Client}, gone)
		}, &h.orphans)
	if n := h.orphans.Load() - before; n > 0 {
		h.Log.Warn("not restored: subscriptions of sessions that ended", "subscriptions", n)
	}
	return subs, nil
}

// storedInflightOfRestored keeps the in-flight messages of restored sessions and deletes
// the records of the others (Mochi skips them, and their records stayed in the store).
func (h *boltStore) storedInflightOfRestored(messages []storage.Message) []storage.Message {
	before := h.orphans.Load()
	messages = restoredOnly(messages, func(m storage.Message) string { return m.Client }, h.loading(),
		func(m storage.Message) {
			h.Hook.OnQosComplete(&mqtt.Client{ID: m.Client}, packets.Packet{PacketID: m.PacketID})
		}, &h.orphans)
	if n := h.orphans.Load() - before; n > 0 {
		h.Log.Warn("not restored: messages held for sessions that ended", "messages", n)
	}
	return messages
}

// expiryHook: an expired session leaves its subscriptions, and its messages are dropped
// (with their records), as when a session ends on disconnect.
type expiryHook struct {
	mqtt.HookBase
	server *mqtt.Server
}

func (h *expiryHook) ID() string { return "shoal-expiry" }

func (h *expiryHook) Provides(b byte) bool { return b == mqtt.OnClientExpired }

func (h *expiryHook) OnClientExpired(cl *mqtt.Client) {
	if current, ok := h.server.Clients.Get(cl.ID); ok && current != cl {
		return // the client id connected again meanwhile: the subscriptions are its own
	}
	h.server.UnsubscribeClient(cl)
	cl.ClearInflights()
}
