// Command schema-registry serves franz-go's srfake (an in-memory implementation of the Confluent
// Schema Registry REST API: subjects, versions, schema ids, references, config, compatibility
// endpoints) on a fixed address, for the integration tests. Built and started by scripts/registry.
//
// It keeps everything in memory: a restart forgets every schema (and ids start again at 1).
package main

import (
	"context"
	"errors"
	"flag"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/sr/srfake"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:8081", "host:port to serve the Confluent API on")
	flag.Parse()

	reg := srfake.NewRegistry()
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatalf("schema-registry: listen %s: %v", *listen, err)
	}
	srv := &http.Server{Handler: reg.Handler(), ReadHeaderTimeout: 10 * time.Second}
	log.Printf("schema-registry: serving the Confluent Schema Registry API on http://%s", ln.Addr())

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
	}()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Printf("schema-registry: %v", err)
		os.Exit(1)
	}
	log.Printf("schema-registry: stopped")
}
