package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	kubeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	fakeremote "k8s.io/cri-client/pkg/fake"
)

func newRuntime(t *testing.T) *runtime {
	t.Helper()
	out, err := os.Create(filepath.Join(t.TempDir(), "containers.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = out.Close() })
	return &runtime{RemoteRuntime: fakeremote.NewFakeRemoteRuntime(), out: out, exiting: map[string]bool{}}
}

func create(t *testing.T, r *runtime, logDirectory, logPath string) string {
	t.Helper()
	req := &kubeapi.CreateContainerRequest{
		PodSandboxId: "sandbox-" + logPath,
		Config: &kubeapi.ContainerConfig{
			Metadata: &kubeapi.ContainerMetadata{Name: "main"},
			Image:    &kubeapi.ImageSpec{Image: "busybox"},
			LogPath:  logPath,
		},
		SandboxConfig: &kubeapi.PodSandboxConfig{
			Metadata:     &kubeapi.PodSandboxMetadata{Name: "pod", Namespace: "ns", Uid: "uid"},
			LogDirectory: logDirectory,
		},
	}
	resp, err := r.CreateContainer(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	status, err := r.ContainerStatus(context.Background(), &kubeapi.ContainerStatusRequest{ContainerId: resp.ContainerId})
	if err != nil {
		t.Fatal(err)
	}
	return status.GetStatus().GetLogPath()
}

// The kubelet reads a container's log from the path in its status, and its container GC removes
// `<that path>*`: the path must be the container's own file under the sandbox's log directory.
func TestAContainersStatusCarriesItsLogPath(t *testing.T) {
	r := newRuntime(t)
	got := create(t, r, "/var/log/pods/ns_pod_uid", "main/0.log")
	if want := "/var/log/pods/ns_pod_uid/main/0.log"; got != want {
		t.Fatalf("log path %q, want %q", got, want)
	}
}

// With no log path from the kubelet, the status still names a file of the container's own: an
// empty one made the kubelet's GC remove every file in its working directory (the glob "*").
func TestWithoutALogPathTheKubeletsCleanUpRemovesNothingElse(t *testing.T) {
	r := newRuntime(t)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "containers.jsonl"), []byte("{}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Chdir(dir)
	for _, c := range [][2]string{{"", ""}, {"relative/dir", "main/0.log"}, {"/var/log/pods/x", ""}} {
		got := create(t, r, c[0], c[1])
		if !filepath.IsAbs(got) {
			t.Fatalf("log path %q for %q is not absolute", got, c)
		}
		matches, err := filepath.Glob(got + "*")
		if err != nil || len(matches) != 0 {
			t.Fatalf("the kubelet's clean-up of %q* would remove %v (%v)", got, matches, err)
		}
	}
}

// A test reads the CDI devices the kubelet passed from the device plugin's answer off the record,
// by their qualified names and in the kubelet's order.
func TestARecordNamesTheContainersCDIDevices(t *testing.T) {
	r := newRuntime(t)
	names := []string{"hami.io/vgpu=uid_main", "nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b"}
	config := &kubeapi.ContainerConfig{
		Metadata: &kubeapi.ContainerMetadata{Name: "main"},
		Image:    &kubeapi.ImageSpec{Image: "busybox"},
	}
	for _, name := range names {
		config.CDIDevices = append(config.CDIDevices, &kubeapi.CDIDevice{Name: name})
	}
	req := &kubeapi.CreateContainerRequest{
		PodSandboxId:  "sandbox",
		Config:        config,
		SandboxConfig: &kubeapi.PodSandboxConfig{Metadata: &kubeapi.PodSandboxMetadata{Name: "pod", Namespace: "ns", Uid: "uid"}},
	}
	if _, err := r.CreateContainer(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(r.out.Name())
	if err != nil {
		t.Fatal(err)
	}
	var rec record
	if err := json.Unmarshal(data, &rec); err != nil {
		t.Fatalf("record %q: %v", data, err)
	}
	if strings.Join(rec.CDIDevices, " ") != strings.Join(names, " ") {
		t.Fatalf("recorded CDI devices %q, want %q", rec.CDIDevices, names)
	}
}
