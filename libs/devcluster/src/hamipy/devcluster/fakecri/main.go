// fakecri serves the upstream CRI fake (k8s.io/cri-client/pkg/fake) on a unix socket, as kubemark's
// hollow nodes do, with two additions a dev cluster needs:
//
//   - every CreateContainer is recorded as one JSON line in the record file (pod, container, envs,
//     mounts, devices, CDI device names): how a test reads what the kubelet passed from the device
//     plugin's Allocate;
//   - a container whose command is exactly ["true"] exits 0 as soon as it starts (an init container
//     that runs to completion); any other runs until the kubelet stops it;
//   - a container's status carries its log path (the sandbox's log directory joined with the
//     container's), as a real runtime's does: the upstream fake leaves it empty, and the kubelet's
//     container GC removes the glob `<log path>*`, which for "" is every file in its working
//     directory (this runtime's record file and socket among them).
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	kubeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	critest "k8s.io/cri-api/pkg/apis/testing"
	fakeremote "k8s.io/cri-client/pkg/fake"
	"k8s.io/cri-client/pkg/util"
)

type mount struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	ReadOnly      bool   `json:"readonly"`
}

type device struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	Permissions   string `json:"permissions"`
}

type record struct {
	ID          string            `json:"id"`
	Namespace   string            `json:"namespace"`
	Pod         string            `json:"pod"`
	PodUID      string            `json:"pod_uid"`
	Container   string            `json:"container"`
	Attempt     uint32            `json:"attempt"`
	Command     []string          `json:"command"`
	Envs        map[string]string `json:"envs"`
	Mounts      []mount           `json:"mounts"`
	Devices     []device          `json:"devices"`
	CDIDevices  []string          `json:"cdi_devices"`
	Annotations map[string]string `json:"annotations"`
}

type runtime struct {
	*fakeremote.RemoteRuntime
	mu      sync.Mutex
	out     *os.File
	exiting map[string]bool
}

func (r *runtime) CreateContainer(ctx context.Context, req *kubeapi.CreateContainerRequest) (*kubeapi.CreateContainerResponse, error) {
	resp, err := r.RemoteRuntime.CreateContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	cfg, labels := req.GetConfig(), req.GetSandboxConfig().GetMetadata()
	r.RuntimeService.Lock()
	if c, ok := r.RuntimeService.Containers[resp.ContainerId]; ok {
		c.LogPath = logPath(req.GetSandboxConfig().GetLogDirectory(), cfg.GetLogPath(), resp.ContainerId)
	}
	r.RuntimeService.Unlock()
	rec := record{
		ID:          resp.ContainerId,
		Namespace:   labels.GetNamespace(),
		Pod:         labels.GetName(),
		PodUID:      labels.GetUid(),
		Container:   cfg.GetMetadata().GetName(),
		Attempt:     cfg.GetMetadata().GetAttempt(),
		Command:     cfg.GetCommand(),
		Envs:        map[string]string{},
		Mounts:      []mount{},
		Devices:     []device{},
		CDIDevices:  []string{},
		Annotations: cfg.GetAnnotations(),
	}
	for _, kv := range cfg.GetEnvs() {
		rec.Envs[kv.Key] = kv.Value
	}
	for _, m := range cfg.GetMounts() {
		rec.Mounts = append(rec.Mounts, mount{m.ContainerPath, m.HostPath, m.Readonly})
	}
	for _, d := range cfg.GetDevices() {
		rec.Devices = append(rec.Devices, device{d.ContainerPath, d.HostPath, d.Permissions})
	}
	for _, d := range cfg.GetCDIDevices() {
		rec.CDIDevices = append(rec.CDIDevices, d.Name)
	}
	line, err := json.Marshal(rec)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	// One write per line: a reader never sees half a record.
	if _, err := r.out.Write(append(line, '\n')); err != nil {
		return nil, err
	}
	if len(rec.Command) == 1 && rec.Command[0] == "true" {
		r.exiting[resp.ContainerId] = true
	}
	return resp, nil
}

// logPath is where a real runtime would write the container's log: always an absolute path of a
// file of the container's own, so that the kubelet's clean-up of `<log path>*` removes nothing else.
func logPath(directory, file, containerID string) string {
	if filepath.IsAbs(directory) && file != "" {
		return filepath.Join(directory, file)
	}
	return filepath.Join("/var/log/pods/fakecri-unnamed", containerID+".log")
}

func (r *runtime) StartContainer(ctx context.Context, req *kubeapi.StartContainerRequest) (*kubeapi.StartContainerResponse, error) {
	resp, err := r.RemoteRuntime.StartContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	exits := r.exiting[req.ContainerId]
	delete(r.exiting, req.ContainerId)
	r.mu.Unlock()
	if exits {
		// Exit code 0 is the zero value: the container "ran" `true`.
		if err := r.RuntimeService.StopContainer(ctx, req.ContainerId, 0); err != nil {
			return nil, err
		}
	}
	return resp, nil
}

// trimCalls keeps the fake's call log (it records every call, for unit tests) from growing for as
// long as the node runs.
func (r *runtime) trimCalls(stop <-chan struct{}) {
	tick := time.NewTicker(time.Minute)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
			r.RuntimeService.Lock()
			r.RuntimeService.Called = nil
			r.RuntimeService.Unlock()
		}
	}
}

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: fakecri unix:///path/to.sock RECORD-FILE")
		os.Exit(2)
	}
	out, err := os.OpenFile(os.Args[2], os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	critest.FakePodSandboxIPs = []string{"127.0.0.1"}
	fake := fakeremote.NewFakeRemoteRuntime()
	fake.ImageService.SetFakeImageSize(1 << 20)
	fake.RuntimeService.FakeStatus = &kubeapi.RuntimeStatus{
		Conditions: []*kubeapi.RuntimeCondition{
			{Type: kubeapi.RuntimeReady, Status: true},
			{Type: kubeapi.NetworkReady, Status: true},
		},
	}
	r := &runtime{RemoteRuntime: fake, out: out, exiting: map[string]bool{}}
	server := grpc.NewServer()
	kubeapi.RegisterRuntimeServiceServer(server, r)
	kubeapi.RegisterImageServiceServer(server, r)
	listener, err := util.CreateListener(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	done := make(chan struct{})
	go r.trimCalls(done)
	go func() {
		if err := server.Serve(listener); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}()
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
	close(done)
	server.Stop()
	_ = out.Close()
}
