package main

// Sessions that ended leave their subscriptions (sessions.go): after a broker restart, and
// when a persistent session expires.

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
)

// members: the client ids subscribed to `topic`, shared or not.
func members(server *mqtt.Server, topic string) []string {
	subs := server.Topics.Subscribers(topic)
	var ids []string
	for _, group := range subs.Shared {
		for id := range group {
			ids = append(ids, id)
		}
	}
	for id := range subs.Subscriptions {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}

// storedSubscribers: the client ids of the subscription records in the store.
func storedSubscribers(t *testing.T, store *boltStore) []string {
	t.Helper()
	subs, err := store.Hook.StoredSubscriptions() // the records, unfiltered
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, s := range subs {
		ids = append(ids, s.Client)
	}
	sort.Strings(ids)
	return ids
}

// everyMessageArrives: a new member of $share/g/in (session expiry 0) gets all 40 messages
// published to `in`, when it is the group's only live member.
func everyMessageArrives(t *testing.T, b *broker) {
	t.Helper()
	live, _ := dialSession(t, b.addr, "w-live", 0, 0)
	if ack, _ := live.subscribe(2, "$share/g/in"); ack.ReasonCodes[0] != 1 {
		t.Fatalf("SUBACK %v", ack.ReasonCodes)
	}
	var want []string
	for i := 0; i < 40; i++ {
		want = append(want, fmt.Sprintf("m%02d", i))
	}
	publish(t, b.server, "in", want...)
	if got := sorted(live.publishes(500 * time.Millisecond)); !equal(got, want) {
		t.Fatalf("the group's live member got %d of %d messages: %v", len(got), len(want), got)
	}
}

func TestSubscriptionsOfSessionsThatEndedAreNotRestored(t *testing.T) {
	// A broker killed while a worker (session expiry 0) was in a shared group: its store
	// still holds the worker's subscription. Mochi 2.7.9 restored the subscription without a
	// client and dealt it a share of the group's messages, which it dropped.
	dir := t.TempDir()
	first := startBrokerOn(t, filepath.Join(dir, "first.db"), &probeHook{})
	worker, _ := dialSession(t, first.addr, "w-dead", 0, 0)
	if ack, _ := worker.subscribe(1, "$share/g/in"); ack.ReasonCodes[0] != 1 {
		t.Fatalf("SUBACK %v", ack.ReasonCodes)
	}
	kept, _ := dial(t, first.addr, "c-kept", 0) // a persistent session: restored
	if ack, _ := kept.subscribe(1, "solo/in"); ack.ReasonCodes[0] != 1 {
		t.Fatalf("SUBACK %v", ack.ReasonCodes)
	}
	if got := storedSubscribers(t, first.store); !equal(got, []string{"c-kept", "w-dead"}) {
		t.Fatalf("stored subscriptions of %v", got)
	}
	// kill -9: the store file as it is while both clients are connected.
	data, err := os.ReadFile(filepath.Join(dir, "first.db"))
	if err != nil {
		t.Fatal(err)
	}
	killed := filepath.Join(dir, "killed.db")
	if err := os.WriteFile(killed, data, 0o600); err != nil {
		t.Fatal(err)
	}

	second := startBrokerOn(t, killed, &probeHook{})
	if got := members(second.server, "in"); len(got) != 0 {
		t.Fatalf("members of $share/g/in after the restart: %v, want none", got)
	}
	if got := members(second.server, "solo/in"); !equal(got, []string{"c-kept"}) {
		t.Fatalf("the persistent session's subscription was not restored: %v", got)
	}
	if got := storedSubscribers(t, second.store); !equal(got, []string{"c-kept"}) {
		t.Fatalf("stored subscriptions after the restart: %v", got)
	}
	everyMessageArrives(t, second)
}

func TestAnExpiredSessionLeavesItsSharedGroup(t *testing.T) {
	// Mochi 2.7.9 deleted an expired session's client but left its subscriptions: a member
	// of a shared group that expired kept its share of the messages, dropped.
	b := startBroker(t, &probeHook{})
	gone, _ := dialSession(t, b.addr, "a-expired", 0, 1)
	if ack, _ := gone.subscribe(1, "$share/g/in"); ack.ReasonCodes[0] != 1 {
		t.Fatalf("SUBACK %v", ack.ReasonCodes)
	}
	b.dropConnection(t, gone, "a-expired")
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, ok := b.server.Clients.Get("a-expired"); !ok {
			break // expired (Mochi looks every second)
		}
		if time.Now().After(deadline) {
			t.Fatal("the session did not expire")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got := members(b.server, "in"); len(got) != 0 {
		t.Fatalf("members of $share/g/in after the expiry: %v, want none", got)
	}
	if got := storedSubscribers(t, b.store); len(got) != 0 {
		t.Fatalf("stored subscriptions after the expiry: %v", got)
	}
	everyMessageArrives(t, b)
}
