// shoal-mochi: Mochi MQTT (github.com/mochi-mqtt/server/v2) with the options shoal needs.
//
// shoal's second broker (docs/brokers.md). Built by `make mochi` into var/bin/shoal-mochi and
// started by shoal.broker.embedded.EmbeddedBroker(broker="mochi") with a JSON configuration it
// renders from a broker profile (shoal.broker._mochi):
//
//	shoal-mochi -config mochi.json
//
// What it sets up: TCP (and optionally TLS) listeners, MQTT 5 capabilities (shared
// subscriptions, QoS 1, retained messages, maximum packet size, message expiry,
// inflight/receive maximum), persistent sessions in a bbolt file, and, when users are
// given, password authentication and per-user ACL rules with Mosquitto's semantics (a
// union of grants, everything else denied). Workarounds for Mochi 2.7.9 defects shoal found
// are in store.go, sessions.go, takeover.go, wildcard.go and will.go, and in the hooks
// below. SIGHUP re-reads the users from the config file; SIGTERM/SIGINT close the server
// (the store is written as it changes).
package main

import (
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/hooks/storage/bolt"
	"github.com/mochi-mqtt/server/v2/listeners"
	"github.com/mochi-mqtt/server/v2/packets"
	"go.etcd.io/bbolt"
)

// Rule is one ACL grant, as in Mosquitto's acl_file: "read", "write" or "readwrite" on a
// topic filter.
type Rule struct {
	Access string `json:"access"`
	Topic  string `json:"topic"`
}

// User is a broker user: the password is stored as hex(sha256(salt + password)).
type User struct {
	Name         string `json:"name"`
	Salt         string `json:"salt"`
	PasswordHash string `json:"password_sha256"`
	Rules        []Rule `json:"rules"`
}

// TLSListener is a listener with TLS.
type TLSListener struct {
	Address           string `json:"address"`
	CAFile            string `json:"ca_file"`
	CertFile          string `json:"cert_file"`
	KeyFile           string `json:"key_file"`
	RequireClientCert bool   `json:"require_client_certificate"`
}

// Config is what shoal renders.
type Config struct {
	Listen                   []string      `json:"listen"`
	TLS                      []TLSListener `json:"tls"`
	Authenticate             bool          `json:"authenticate"`
	HonourReceiveMaximum     bool          `json:"honour_receive_maximum"`
	AllowAnonymous           bool          `json:"allow_anonymous"`
	ACL                      bool          `json:"acl"`
	Users                    []User        `json:"users"`
	StoreFile                string        `json:"store_file"`
	LogFile                  string        `json:"log_file"`
	LogLevel                 string        `json:"log_level"`
	SysInterval              int64         `json:"sys_interval"`
	MaximumPacketSize        uint32        `json:"maximum_packet_size"`
	MaximumInflight          uint16        `json:"maximum_inflight"`
	ReceiveMaximum           uint16        `json:"receive_maximum"`
	MaximumClientWrites      int32         `json:"maximum_client_writes_pending"`
	MaximumSessionExpiry     uint32        `json:"maximum_session_expiry_interval"`
	MaximumMessageExpiry     int64         `json:"maximum_message_expiry_interval"`
	TopicAliasMaximum        uint16        `json:"topic_alias_maximum"`
	ObscureNotAuthorized     bool          `json:"obscure_not_authorized"`
	RestoreSysInfoOnRestart  bool          `json:"restore_sys_info_on_restart"`
	ClientNetWriteBufferSize int           `json:"client_net_write_buffer_size"`
	ClientNetReadBufferSize  int           `json:"client_net_read_buffer_size"`
}

func readConfig(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	cfg := new(Config)
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(cfg); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return cfg, nil
}

// accessHook authenticates users and applies their ACL rules.
type accessHook struct {
	mqtt.HookBase
	mu             sync.RWMutex
	authenticate   bool
	allowAnonymous bool
	acl            bool
	users          map[string]User
}

func (h *accessHook) ID() string { return "shoal-access" }

func (h *accessHook) Provides(b byte) bool {
	return bytes.Contains([]byte{mqtt.OnConnectAuthenticate, mqtt.OnACLCheck}, []byte{b})
}

func (h *accessHook) load(cfg *Config) {
	users := make(map[string]User, len(cfg.Users))
	for _, u := range cfg.Users {
		users[u.Name] = u
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.authenticate = cfg.Authenticate
	h.allowAnonymous = cfg.AllowAnonymous
	h.acl = cfg.ACL
	h.users = users
}

func (h *accessHook) OnConnectAuthenticate(cl *mqtt.Client, pk packets.Packet) bool {
	h.mu.RLock()
	defer h.mu.RUnlock()
	if !h.authenticate {
		return h.allowAnonymous // no password file: credentials are not checked (Mosquitto)
	}
	name := string(pk.Connect.Username)
	if name == "" && !pk.Connect.PasswordFlag {
		return h.allowAnonymous
	}
	u, ok := h.users[name]
	if !ok {
		return false
	}
	sum := sha256.Sum256(append([]byte(u.Salt), pk.Connect.Password...))
	want, err := hex.DecodeString(u.PasswordHash)
	return err == nil && subtle.ConstantTimeCompare(sum[:], want) == 1
}

// OnACLCheck: with no ACL every client may do anything (Mosquitto without acl_file). With
// one, a user may publish to a topic a write/readwrite rule matches, and receive a message
// whose topic a read/readwrite rule matches. A SUBSCRIBE is checked with its filter (without
// a $share/<group>/ prefix): granted when a read rule covers some topic it can match, so a
// filter wider than the rules is granted and then filtered per message, as Mosquitto does.
func (h *accessHook) OnACLCheck(cl *mqtt.Client, topic string, write bool) bool {
	h.mu.RLock()
	defer h.mu.RUnlock()
	if !h.acl {
		return true
	}
	u, ok := h.users[string(cl.Properties.Username)]
	if !ok {
		return false
	}
	if !write && strings.HasPrefix(topic, "$share/") {
		parts := strings.SplitN(topic, "/", 3)
		if len(parts) < 3 {
			return false
		}
		topic = parts[2]
	}
	isFilter := strings.ContainsAny(topic, "+#")
	for _, r := range u.Rules {
		canRead := r.Access == "read" || r.Access == "readwrite"
		canWrite := r.Access == "write" || r.Access == "readwrite"
		if write && canWrite && matches(r.Topic, topic) {
			return true
		}
		if !write && canRead {
			if isFilter && overlaps(r.Topic, topic) {
				return true
			}
			if !isFilter && matches(r.Topic, topic) {
				return true
			}
		}
	}
	return false
}

// matches: whether topic filter `filter` matches topic name `topic` (MQTT 4.7; a filter
// starting with a wildcard does not match a $ topic).
func matches(filter, topic string) bool {
	if strings.HasPrefix(topic, "$") && !strings.HasPrefix(filter, "$") {
		return false
	}
	f := strings.Split(filter, "/")
	t := strings.Split(topic, "/")
	for i, level := range f {
		if level == "#" {
			return true
		}
		if i >= len(t) {
			return false
		}
		if level != "+" && level != t[i] {
			return false
		}
	}
	return len(f) == len(t)
}

// overlaps: whether some topic name matches both filters.
func overlaps(a, b string) bool {
	x := strings.Split(a, "/")
	y := strings.Split(b, "/")
	for i := 0; ; i++ {
		if i < len(x) && x[i] == "#" || i < len(y) && y[i] == "#" {
			return true
		}
		if i >= len(x) || i >= len(y) {
			return len(x) == len(y)
		}
		if x[i] != "+" && y[i] != "+" && x[i] != y[i] {
			return false
		}
	}
}

// announceHook puts the Maximum Packet Size in every MQTT 5 CONNACK. Mochi 2.7.9 enforces
// Capabilities.MaximumPacketSize on what clients send but does not announce it (Mosquitto
// does); shoal's publishers check their payloads against the announced size.
type announceHook struct {
	mqtt.HookBase
	maximumPacketSize uint32
}

func (h *announceHook) ID() string { return "shoal-announce" }

func (h *announceHook) Provides(b byte) bool { return b == mqtt.OnPacketEncode }

func (h *announceHook) OnPacketEncode(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	if pk.FixedHeader.Type == packets.Connack && cl.Properties.ProtocolVersion == 5 {
		pk.Properties.MaximumPacketSize = h.maximumPacketSize
	}
	return pk
}

// publishMosquittoCounters publishes, retained, the $SYS counters shoal reads under the names
// Mosquitto gives them (shoal.broker.sysmon): Mochi's own tree has no per-client queue drops
// in $SYS/broker/messages/dropped (it keeps them in Info.InflightDropped) and calls its
// store "messages/inflight".
func publishMosquittoCounters(server *mqtt.Server, every time.Duration) {
	ticker := time.NewTicker(every)
	defer ticker.Stop()
	for range ticker.C {
		info := server.Info.Clone()
		counters := map[string]int64{
			"$SYS/broker/publish/messages/dropped": info.MessagesDropped + info.InflightDropped,
			"$SYS/broker/store/messages/count":     info.Inflight,
		}
		for topic, value := range counters {
			if err := server.Publish(topic, []byte(fmt.Sprint(value)), true, 0); err != nil {
				return // closed
			}
		}
	}
}

// flowHook: Mochi 2.7.9's flow control towards clients that set a Receive Maximum (shoal's
// workers do, for back-pressure) loses messages. Once a client's send quota is used up, Mochi
// parks further QoS 1 messages in its inflight store (Expiry -1) and, after each packet from
// the client, sends the oldest parked one and deletes it from the store: its PUBACK then finds
// nothing and never returns the quota (delivery stalls), and the oracle tests saw about one
// batch in five never reach the worker (docs/brokers.md). Unless honour_receive_maximum is
// set, the hook gives every session no send quota, which Mochi reads as "no limit": messages
// are written at once and back-pressure is TCP's.
//
// The quota goes before the session is taken over and registered (OnSessionEstablish):
// Mochi sets it from the client's Receive Maximum when it connects (and again when it copies
// a resumed session's messages), and the client can be dealt messages from its registration
// on, while its queue is still being re-sent. With the quota set only once the session was
// established, messages beyond it in that time were parked, and then never sent (until the
// next reconnect): a resumed subscriber with a small Receive Maximum (a worker asks for 8)
// did not get what was dealt to it while its queue was re-sent.
type flowHook struct {
	mqtt.HookBase
	honourReceiveMaximum bool
}

func (h *flowHook) ID() string { return "shoal-flow" }

func (h *flowHook) Provides(b byte) bool {
	return b == mqtt.OnSessionEstablish || b == mqtt.OnSessionEstablished
}

func (h *flowHook) OnSessionEstablish(cl *mqtt.Client, _ packets.Packet) {
	if !h.honourReceiveMaximum {
		cl.Properties.Props.ReceiveMaximum = 0 // what Mochi resets the quota to on a resume
		cl.State.Inflight.ResetSendQuota(0)
	}
}

func (h *flowHook) OnSessionEstablished(cl *mqtt.Client, _ packets.Packet) {
	if !h.honourReceiveMaximum {
		cl.State.Inflight.ResetSendQuota(0)
	}
}

// orderHook keeps a resumed session's queued messages in publication order. Mochi 2.7.9
// resends a session's inflight store sorted by uint16(Created), and Created is the publish
// time in seconds: messages of the same second came back in random order (MQTT 5 section
// 4.6 wants them in order; tests/integration/test_session_takeover.py). The hook numbers
// every publish in Created (the expiry was computed from the real time before the hook
// runs; with maximum_message_expiry_interval 0 nothing else reads Created but the store).
// The order holds within any 65,536 consecutive publishes.
type orderHook struct {
	mqtt.HookBase
	next atomic.Int64
}

func (h *orderHook) ID() string { return "shoal-order" }

func (h *orderHook) Provides(b byte) bool { return b == mqtt.OnPublish }

func (h *orderHook) OnPublish(_ *mqtt.Client, pk packets.Packet) (packets.Packet, error) {
	pk.Created = h.next.Add(1)
	return pk, nil
}

func newLogger(cfg *Config) (*slog.Logger, *os.File, error) {
	level := slog.LevelWarn
	if err := level.UnmarshalText([]byte(cfg.LogLevel)); cfg.LogLevel != "" && err != nil {
		return nil, nil, fmt.Errorf("log_level %q: %w", cfg.LogLevel, err)
	}
	out := os.Stderr
	if cfg.LogFile != "" {
		f, err := os.OpenFile(cfg.LogFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			return nil, nil, err
		}
		out = f
	}
	return slog.New(slog.NewTextHandler(out, &slog.HandlerOptions{Level: level})), out, nil
}

func tlsConfig(l TLSListener) (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(l.CertFile, l.KeyFile)
	if err != nil {
		return nil, err
	}
	conf := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if l.CAFile != "" {
		pem, err := os.ReadFile(l.CAFile)
		if err != nil {
			return nil, err
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, errors.New("no certificate in " + l.CAFile)
		}
		conf.ClientCAs = pool
		if l.RequireClientCert {
			conf.ClientAuth = tls.RequireAndVerifyClientCert
		} else {
			conf.ClientAuth = tls.VerifyClientCertIfGiven
		}
	}
	return conf, nil
}

func run(configPath string) error {
	cfg, err := readConfig(configPath)
	if err != nil {
		return err
	}
	logger, _, err := newLogger(cfg)
	if err != nil {
		return err
	}
	b, err := newServer(cfg, logger)
	if err != nil {
		return err
	}
	server := b.server
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	if err := server.Serve(); err != nil {
		return err
	}
	go publishMosquittoCounters(server, time.Duration(server.Options.SysTopicResendInterval)*time.Second)
	logger.Warn("shoal-mochi listening", "version", mqtt.Version, "listen", cfg.Listen)
	for sig := range signals {
		if sig == syscall.SIGHUP {
			fresh, err := readConfig(configPath)
			if err != nil {
				logger.Error("reload failed, keeping the users", "error", err)
				continue
			}
			b.access.load(fresh)
			logger.Warn("users reloaded", "users", len(fresh.Users))
			continue
		}
		break
	}
	return server.Close()
}

// built is a shoal-mochi server and the hooks run() and the tests reach.
type built struct {
	server *mqtt.Server
	access *accessHook
	store  *boltStore // nil without persistence
}

// newServer: Mochi with shoal's capabilities, hooks and listeners, not yet serving.
func newServer(cfg *Config, logger *slog.Logger) (*built, error) {
	caps := mqtt.NewDefaultServerCapabilities()
	caps.MaximumPacketSize = cfg.MaximumPacketSize
	if cfg.MaximumInflight > 0 {
		caps.MaximumInflight = cfg.MaximumInflight
	}
	if cfg.ReceiveMaximum > 0 {
		caps.ReceiveMaximum = cfg.ReceiveMaximum
	}
	if cfg.MaximumClientWrites > 0 {
		caps.MaximumClientWritesPending = cfg.MaximumClientWrites
	}
	if cfg.MaximumSessionExpiry > 0 {
		caps.MaximumSessionExpiryInterval = cfg.MaximumSessionExpiry
	}
	caps.MaximumMessageExpiryInterval = cfg.MaximumMessageExpiry
	caps.TopicAliasMaximum = cfg.TopicAliasMaximum
	caps.Compatibilities.ObscureNotAuthorized = cfg.ObscureNotAuthorized
	// Mochi 2.7.9 copies a PUBLISH's properties into its PUBACK (user properties included);
	// paho-mqtt then drops the connection, so a worker publishing a dead letter (which names
	// its reason in user properties) was cut off and reconnected each time. Acks without
	// properties, as Mosquitto sends them.
	caps.Compatibilities.NoInheritedPropertiesOnAck = true
	caps.Compatibilities.RestoreSysInfoOnRestart = cfg.RestoreSysInfoOnRestart
	caps.MinimumProtocolVersion = 3

	sysInterval := cfg.SysInterval
	if sysInterval <= 0 {
		sysInterval = 1
	}
	server := mqtt.New(&mqtt.Options{
		InlineClient:             true, // for the Mosquitto-named $SYS counters below
		Capabilities:             caps,
		Logger:                   logger,
		SysTopicResendInterval:   sysInterval,
		ClientNetWriteBufferSize: cfg.ClientNetWriteBufferSize,
		ClientNetReadBufferSize:  cfg.ClientNetReadBufferSize,
	})

	access := new(accessHook)
	access.load(cfg)
	if err := server.AddHook(access, nil); err != nil {
		return nil, err
	}
	if cfg.MaximumPacketSize > 0 {
		announce := &announceHook{maximumPacketSize: cfg.MaximumPacketSize}
		if err := server.AddHook(announce, nil); err != nil {
			return nil, err
		}
	}
	order := new(orderHook)
	order.next.Store(time.Now().Unix() << 16)
	if err := server.AddHook(order, nil); err != nil {
		return nil, err
	}
	flow := &flowHook{honourReceiveMaximum: cfg.HonourReceiveMaximum}
	var store *boltStore
	if cfg.StoreFile != "" {
		// NoSync: every change is written to the file (the page cache) at once, so a killed
		// broker loses nothing; only a machine crash can lose the last writes.
		store = &boltStore{restored: func(id string) bool {
			_, ok := server.Clients.Get(id)
			return ok
		}}
		err := server.AddHook(store, &bolt.Options{
			Path:    cfg.StoreFile,
			Options: &bbolt.Options{Timeout: 2 * time.Second, NoSync: true},
		})
		if err != nil {
			return nil, fmt.Errorf("store %s: %w", cfg.StoreFile, err)
		}
	}
	if err := server.AddHook(&expiryHook{server: server}, nil); err != nil {
		return nil, err
	}
	if err := server.AddHook(flow, nil); err != nil {
		return nil, err
	}
	if err := server.AddHook(new(sysWriteHook), nil); err != nil {
		return nil, err
	}
	if err := server.AddHook(newPacketIDHook(server), nil); err != nil {
		return nil, err
	}
	if err := server.AddHook(newTakeoverHook(server, store), nil); err != nil {
		return nil, err
	}
	if err := server.AddHook(newParentHook(), nil); err != nil {
		return nil, err
	}
	will := &willHook{empty: make(map[string]bool)}
	if err := server.AddHook(will, nil); err != nil {
		return nil, err
	}
	for i, address := range cfg.Listen {
		tcp := listeners.NewTCP(listeners.Config{ID: fmt.Sprintf("tcp%d", i), Address: address})
		l := &emptyWillListener{Listener: tcp, hook: will}
		if err := server.AddListener(l); err != nil {
			return nil, fmt.Errorf("listener %s: %w", address, err)
		}
	}
	for i, tl := range cfg.TLS {
		conf, err := tlsConfig(tl)
		if err != nil {
			return nil, fmt.Errorf("TLS listener %s: %w", tl.Address, err)
		}
		tcp := listeners.NewTCP(listeners.Config{ID: fmt.Sprintf("tls%d", i), Address: tl.Address, TLSConfig: conf})
		l := &emptyWillListener{Listener: tcp, hook: will}
		if err := server.AddListener(l); err != nil {
			return nil, fmt.Errorf("TLS listener %s: %w", tl.Address, err)
		}
	}
	return &built{server: server, access: access, store: store}, nil
}

func main() {
	configPath := flag.String("config", "", "the JSON configuration shoal renders")
	version := flag.Bool("version", false, "print the Mochi MQTT version and exit")
	flag.Parse()
	if *version {
		fmt.Println(mqtt.Version)
		return
	}
	if *configPath == "" {
		fmt.Fprintln(os.Stderr, "usage: shoal-mochi -config FILE")
		os.Exit(2)
	}
	if err := run(*configPath); err != nil {
		fmt.Fprintln(os.Stderr, "shoal-mochi:", err)
		os.Exit(1)
	}
}
