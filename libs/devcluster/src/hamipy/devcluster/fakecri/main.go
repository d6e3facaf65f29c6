// fakecri serves the upstream CRI fake (k8s.io/cri-client/pkg/fake) on a unix socket.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"

	fakeremote "k8s.io/cri-client/pkg/fake"
	critest "k8s.io/cri-api/pkg/apis/testing"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: fakecri unix:///path/to.sock")
		os.Exit(2)
	}
	critest.FakePodSandboxIPs = []string{"127.0.0.1"}
	runtime := fakeremote.NewFakeRemoteRuntime()
	runtime.ImageService.SetFakeImageSize(1 << 20)
	if err := runtime.Start(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
	runtime.Stop()
}
