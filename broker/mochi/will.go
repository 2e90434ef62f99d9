package main

// Empty Will payloads. MQTT allows a zero-length Will Payload ([MQTT-3.1.2-9] only asks the
// fields to be present), and shoal's pool combiners use one, retained, so that their death
// clears their presence. Mochi 2.7.9 refuses such a CONNECT ("protocol violation: will flag
// no payload"). emptyWillListener rewrites an empty Will Payload in the CONNECT into one
// placeholder byte before Mochi reads it, and willHook turns it back into an empty payload
// when the Will is sent.

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/listeners"
)

const maxConnectSize = 1 << 20 // larger CONNECTs pass through untouched

var willPlaceholder = []byte{0}

// willHook remembers which clients connected with an empty Will Payload.
type willHook struct {
	mqtt.HookBase
	mu    sync.Mutex
	empty map[string]bool
}

func (h *willHook) ID() string { return "shoal-empty-will" }

func (h *willHook) Provides(b byte) bool { return b == mqtt.OnWill }

func (h *willHook) note(clientID string, empty bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if empty {
		h.empty[clientID] = true
	} else {
		delete(h.empty, clientID)
	}
}

func (h *willHook) OnWill(cl *mqtt.Client, will mqtt.Will) (mqtt.Will, error) {
	h.mu.Lock()
	empty := h.empty[cl.ID]
	h.mu.Unlock()
	if empty && bytes.Equal(will.Payload, willPlaceholder) {
		will.Payload = []byte{}
	}
	return will, nil
}

// emptyWillListener wraps a listener: each connection's first packet goes through rewrite.
type emptyWillListener struct {
	listeners.Listener
	hook *willHook
}

func (l *emptyWillListener) Serve(establish listeners.EstablishFn) {
	l.Listener.Serve(func(id string, c net.Conn) error {
		return establish(id, &willConn{Conn: c, hook: l.hook, reader: bufio.NewReader(c)})
	})
}

type willConn struct {
	net.Conn
	hook    *willHook
	reader  *bufio.Reader
	started bool
	pending []byte
}

func (c *willConn) Read(p []byte) (int, error) {
	if !c.started {
		c.started = true
		first, err := c.firstPacket()
		if err != nil {
			return 0, err
		}
		c.pending = first
	}
	if len(c.pending) > 0 {
		n := copy(p, c.pending)
		c.pending = c.pending[n:]
		return n, nil
	}
	return c.reader.Read(p)
}

// firstPacket reads the first packet and returns its bytes, a CONNECT with an empty Will
// Payload rewritten.
func (c *willConn) firstPacket() ([]byte, error) {
	kind, err := c.reader.ReadByte()
	if err != nil {
		return nil, err
	}
	header := []byte{kind}
	remaining, multiplier := 0, 1
	for i := 0; ; i++ {
		b, err := c.reader.ReadByte()
		if err != nil {
			return nil, err
		}
		header = append(header, b)
		remaining += int(b&0x7f) * multiplier
		multiplier *= 128
		if b&0x80 == 0 {
			break
		}
		if i == 3 {
			return header, nil // malformed: let Mochi say so
		}
	}
	if kind != 0x10 || remaining > maxConnectSize {
		return header, nil
	}
	body := make([]byte, remaining)
	if _, err := io.ReadFull(c.reader, body); err != nil {
		return nil, err
	}
	rewritten, clientID, empty, err := rewriteConnect(body)
	if err != nil {
		return append(header, body...), nil // not ours to judge: Mochi validates it
	}
	c.hook.note(clientID, empty)
	if !empty {
		return append(header, body...), nil
	}
	return append(append([]byte{kind}, varint(len(rewritten))...), rewritten...), nil
}

var errShort = errors.New("short CONNECT")

type cursor struct {
	b   []byte
	pos int
}

func (c *cursor) take(n int) ([]byte, error) {
	if n < 0 || c.pos+n > len(c.b) {
		return nil, errShort
	}
	out := c.b[c.pos : c.pos+n]
	c.pos += n
	return out, nil
}

func (c *cursor) uint16() (int, error) {
	b, err := c.take(2)
	if err != nil {
		return 0, err
	}
	return int(binary.BigEndian.Uint16(b)), nil
}

func (c *cursor) varint() (int, error) {
	value, multiplier := 0, 1
	for i := 0; i < 4; i++ {
		b, err := c.take(1)
		if err != nil {
			return 0, err
		}
		value += int(b[0]&0x7f) * multiplier
		multiplier *= 128
		if b[0]&0x80 == 0 {
			return value, nil
		}
	}
	return 0, errShort
}

func (c *cursor) skipString() (string, error) {
	n, err := c.uint16()
	if err != nil {
		return "", err
	}
	b, err := c.take(n)
	return string(b), err
}

// rewriteConnect: the CONNECT body with an empty Will Payload replaced by willPlaceholder.
func rewriteConnect(body []byte) (out []byte, clientID string, empty bool, err error) {
	c := &cursor{b: body}
	if _, err = c.skipString(); err != nil { // protocol name
		return
	}
	level, err := c.take(1)
	if err != nil {
		return
	}
	flags, err := c.take(1)
	if err != nil {
		return
	}
	if _, err = c.take(2); err != nil { // keepalive
		return
	}
	v5 := level[0] == 5
	if v5 {
		var n int
		if n, err = c.varint(); err != nil {
			return
		}
		if _, err = c.take(n); err != nil {
			return
		}
	}
	if clientID, err = c.skipString(); err != nil {
		return
	}
	if flags[0]&0x04 == 0 { // no Will
		return body, clientID, false, nil
	}
	if v5 {
		var n int
		if n, err = c.varint(); err != nil {
			return
		}
		if _, err = c.take(n); err != nil {
			return
		}
	}
	if _, err = c.skipString(); err != nil { // Will Topic
		return
	}
	at := c.pos
	n, err := c.uint16()
	if err != nil || n != 0 {
		return body, clientID, false, err
	}
	out = make([]byte, 0, len(body)+len(willPlaceholder))
	out = append(out, body[:at]...)
	out = binary.BigEndian.AppendUint16(out, uint16(len(willPlaceholder)))
	out = append(out, willPlaceholder...)
	out = append(out, body[at+2:]...)
	return out, clientID, true, nil
}

func varint(n int) []byte {
	var out []byte
	for {
		b := byte(n % 128)
		n /= 128
		if n > 0 {
			b |= 0x80
		}
		out = append(out, b)
		if n == 0 {
			return out
		}
	}
}
