#!/usr/bin/env python3
"""The kubelet's side of a device plugin, on real gRPC (grpcio) and real protobuf.

Serves the registration socket (`<dir>/kubelet.sock`) and the pod-resources API, and when a
plugin registers, dials it back as the kubelet's device manager does: GetDevicePluginOptions,
then ListAndWatch. Commands come as JSON lines on stdin, events leave as JSON lines on
stdout:

  {"allocate": {"resource": R, "ids": [..], "pod": "ns/name", "container": C}}
      -> {"event": "allocated", "resource": R, "response": {...}}   (and the pod-resources
         API lists the ids for that container from then on)
      -> {"event": "refused", "resource": R, "code": N, "message": ".."}
  {"restart": true}   the kubelet restarts: every socket in <dir> is removed and the
                      registration socket made anew (plugins must register again)

Events: {"event": "ready"}, {"event": "registered", "resource": R, "endpoint": E,
"version": V, "options": {...}, "devices": [{"id": .., "health": ..}]}.

The messages come from deviceplugin.proto and podresources.proto (the kubelet's field
numbers), compiled here with grpcio-tools.
"""
import argparse
import json
import os
import sys
import tempfile
import threading
from concurrent import futures

import grpc
from grpc_tools import protoc

HERE = os.path.dirname(os.path.abspath(__file__))


def compile_protos(out):
    for proto in ("deviceplugin.proto", "podresources.proto"):
        rc = protoc.main(["protoc", f"-I{HERE}", f"--python_out={out}", f"--grpc_python_out={out}", proto])
        if rc != 0:
            sys.exit(f"protoc failed on {proto}")
    sys.path.insert(0, out)


LOCK = threading.Lock()
# The kubelet dials plugins with the authority "localhost" (since Kubernetes 1.26,
# kubernetes/kubernetes#112597); before, grpc-go sent the socket's path, which strict HTTP/2
# servers (the plugin's among them) refuse as a malformed authority.
DIAL = [("grpc.default_authority", "localhost")]


def emit(**ev):
    with LOCK:
        sys.stdout.write(json.dumps(ev) + "\n")
        sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="the device-plugin directory (kubelet.sock, plugins' sockets)")
    ap.add_argument("--pod-resources", required=True, help="the pod-resources socket")
    a = ap.parse_args()
    gen = tempfile.mkdtemp(prefix="coloc-kubelet-proto-")
    compile_protos(gen)
    import deviceplugin_pb2 as dp
    import deviceplugin_pb2_grpc as dpg
    import podresources_pb2 as pr
    import podresources_pb2_grpc as prg

    plugins = {}  # resource -> endpoint
    assigned = {}  # (pod, container) -> {resource: [ids]}

    def watch(resource, endpoint):
        ch = grpc.insecure_channel(f"unix://{os.path.join(a.dir, endpoint)}", options=DIAL)
        stub = dpg.DevicePluginStub(ch)
        try:
            opts = stub.GetDevicePluginOptions(dp.Empty(), timeout=5)
            first = True
            for resp in stub.ListAndWatch(dp.Empty()):
                devices = [{"id": d.ID, "health": d.health} for d in resp.devices]
                if first:
                    emit(event="registered", resource=resource, endpoint=endpoint,
                         options={"pre_start_required": opts.pre_start_required,
                                  "get_preferred_allocation_available": opts.get_preferred_allocation_available},
                         devices=devices)
                    first = False
                else:
                    emit(event="devices", resource=resource, devices=devices)
            emit(event="stream_closed", resource=resource)
        except grpc.RpcError as e:
            # As the kubelet does, the plugin is dropped until it registers again.
            emit(event="stream_failed", resource=resource, code=e.code().value[0], message=e.details())

    class Registration(dpg.RegistrationServicer):
        def Register(self, req, ctx):
            if req.version != "v1beta1":
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {req.version}")
            plugins[req.resource_name] = req.endpoint
            threading.Thread(target=watch, args=(req.resource_name, req.endpoint), daemon=True).start()
            return dp.Empty()

    class Lister(prg.PodResourcesListerServicer):
        def List(self, req, ctx):
            out = pr.ListPodResourcesResponse()
            pods = {}
            for (pod, container), res in sorted(assigned.items()):
                pods.setdefault(pod, []).append((container, res))
            for pod, containers in pods.items():
                ns, name = pod.split("/", 1)
                p = out.pod_resources.add(name=name, namespace=ns)
                for container, res in containers:
                    c = p.containers.add(name=container)
                    for r, ids in res.items():
                        c.devices.add(resource_name=r, device_ids=ids)
            return out

    def registration_server():
        sock = os.path.join(a.dir, "kubelet.sock")
        s = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        dpg.add_RegistrationServicer_to_server(Registration(), s)
        s.add_insecure_port(f"unix://{sock}")
        s.start()
        return s

    os.makedirs(a.dir, exist_ok=True)
    reg = registration_server()
    lister = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    prg.add_PodResourcesListerServicer_to_server(Lister(), lister)
    lister.add_insecure_port(f"unix://{a.pod_resources}")
    lister.start()
    emit(event="ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        if "allocate" in cmd:
            al = cmd["allocate"]
            r = al["resource"]
            ch = grpc.insecure_channel(f"unix://{os.path.join(a.dir, plugins[r])}", options=DIAL)
            stub = dpg.DevicePluginStub(ch)
            req = dp.AllocateRequest()
            req.container_requests.add(devices_ids=al["ids"])
            try:
                resp = stub.Allocate(req, timeout=5)
            except grpc.RpcError as e:
                emit(event="refused", resource=r, code=e.code().value[0], message=e.details())
                continue
            c = resp.container_responses[0]
            assigned.setdefault((al["pod"], al["container"]), {})[r] = list(al["ids"])
            emit(event="allocated", resource=r, response={
                "envs": dict(c.envs),
                "mounts": [{"container_path": m.container_path, "host_path": m.host_path, "read_only": m.read_only} for m in c.mounts],
                "cdi_devices": [d.name for d in c.cdi_devices],
                "containers": len(resp.container_responses),
            })
        elif cmd.get("restart"):
            reg.stop(0).wait()
            for f in os.listdir(a.dir):
                if f.endswith(".sock"):
                    os.unlink(os.path.join(a.dir, f))
            plugins.clear()
            reg = registration_server()
            emit(event="restarted")
    reg.stop(0)
    lister.stop(0)


if __name__ == "__main__":
    main()
