package main

// "#" after "+". A multi-level wildcard also matches its parent level (MQTT 4.7.1.2:
// "sport/tennis/#" matches "sport/tennis"), so "a/+/#" matches "a/x". Mochi 2.7.9 skips that
// case when the parent level is a "+" (topics.go, scanSubscribers: `partKey != "+"`; the
// retained-message scan skips it too): a Sparkplug adapter subscribed to
// "<namespace>/+/+/+/#" got every device message (4 levels) and no node message (NBIRTH,
// NDEATH: 3 levels), refused all data as "before its NBIRTH" and sealed nothing
// (test_sparkplug_births_aliases_deaths_and_rebirth_requests; 298 dead letters instead of 1).
//
// parentHook adds, for every filter ending in "+/#", the same subscription without the "/#"
// (a companion: "a/+/#" brings "a/+") unless the client holds that filter itself, and takes
// it away again with the filter. Mochi merges a client's matching subscriptions into one
// PUBLISH and Mochi never matches the parent through the "#" filter, so each message still
// arrives once. The SUBACK and UNSUBACK carry only the reason codes of the client's own
// filters. Which companions were added is remembered per client id while the broker runs:
// after a broker restart, an UNSUBSCRIBE of "a/+/#" leaves "a/+" in place (shoal never
// unsubscribes such a filter; its adapters keep their subscriptions).

import (
	"strings"
	"sync"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

type parentHook struct {
	mqtt.HookBase
	mu         sync.Mutex
	companions map[string]map[string]bool // client id -> companion filters this hook added
	asked      map[*mqtt.Client]int       // reason codes the client's SUBSCRIBE/UNSUBSCRIBE asked for
}

func newParentHook() *parentHook {
	return &parentHook{
		companions: make(map[string]map[string]bool),
		asked:      make(map[*mqtt.Client]int),
	}
}

func (h *parentHook) ID() string { return "shoal-parent-level" }

func (h *parentHook) Provides(b byte) bool {
	return b == mqtt.OnSubscribe || b == mqtt.OnUnsubscribe || b == mqtt.OnPacketEncode ||
		b == mqtt.OnDisconnect
}

// companion: "a/+/#" -> "a/+" (also "+/#" -> "+", "$share/g/a/+/#" -> "$share/g/a/+").
func companion(filter string) (string, bool) {
	parent, found := strings.CutSuffix(filter, "/#")
	if !found || parent[strings.LastIndexByte(parent, '/')+1:] != "+" {
		return "", false
	}
	return parent, true
}

func (h *parentHook) OnSubscribe(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	asked := len(pk.Filters)
	requested := make(map[string]bool, asked)
	for _, sub := range pk.Filters {
		requested[sub.Filter] = true
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	mine := h.companions[cl.ID]
	var extra packets.Subscriptions
	for _, sub := range pk.Filters {
		if mine[sub.Filter] {
			delete(mine, sub.Filter) // the client subscribes to it itself now
		}
		parent, ok := companion(sub.Filter)
		if !ok || requested[parent] {
			continue
		}
		if _, held := cl.State.Subscriptions.Get(parent); held && !mine[parent] {
			continue // the client's own
		}
		c := sub
		c.Filter = parent
		extra = append(extra, c)
		requested[parent] = true
		if mine == nil {
			mine = make(map[string]bool)
			h.companions[cl.ID] = mine
		}
		mine[parent] = true
	}
	if len(extra) == 0 {
		return pk
	}
	h.asked[cl] = asked
	pk.Filters = append(append(packets.Subscriptions{}, pk.Filters...), extra...)
	return pk
}

func (h *parentHook) OnUnsubscribe(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	h.mu.Lock()
	defer h.mu.Unlock()
	mine := h.companions[cl.ID]
	var extra packets.Subscriptions
	for _, sub := range pk.Filters {
		if parent, ok := companion(sub.Filter); ok && mine[parent] {
			extra = append(extra, packets.Subscription{Filter: parent})
			delete(mine, parent)
		}
	}
	if len(extra) == 0 {
		return pk
	}
	h.asked[cl] = len(pk.Filters)
	pk.Filters = append(append(packets.Subscriptions{}, pk.Filters...), extra...)
	return pk
}

// OnPacketEncode: the SUBACK or UNSUBACK answers the client's filters only.
func (h *parentHook) OnPacketEncode(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	if pk.FixedHeader.Type != packets.Suback && pk.FixedHeader.Type != packets.Unsuback {
		return pk
	}
	h.mu.Lock()
	asked, ok := h.asked[cl]
	delete(h.asked, cl)
	h.mu.Unlock()
	if ok && asked < len(pk.ReasonCodes) {
		pk.ReasonCodes = pk.ReasonCodes[:asked]
	}
	return pk
}

// OnDisconnect forgets the connection's pending reply, and a session's companions when the
// session ends.
func (h *parentHook) OnDisconnect(cl *mqtt.Client, _ error, expire bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.asked, cl)
	if expire && !cl.IsTakenOver() {
		delete(h.companions, cl.ID)
	}
}
