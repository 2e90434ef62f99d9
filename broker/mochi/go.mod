module shoal/broker/mochi

go 1.21

require (
	github.com/mochi-mqtt/server/v2 v2.7.9
	go.etcd.io/bbolt v1.3.5
)

require (
	github.com/gorilla/websocket v1.5.0 // indirect
	github.com/rs/xid v1.4.0 // indirect
	golang.org/x/sys v0.28.0 // indirect
)
