#!/usr/bin/python3
"""tests/cri/cri_client.py — a minimal Kubernetes CRI (runtime.v1) client for ferry's
end-to-end tests: what the kubelet would ask containerd, one call per invocation.

It compiles tests/cri/cri.proto with `protoc --python_out` into a temporary directory
at start (no generated code is checked in) and calls the RPCs through hand-written
`channel.unary_unary` stubs, so only Debian's python3-grpcio, python3-protobuf and
protobuf-compiler are needed. It must not grow test logic: the shell script decides
what passes; this prints the responses as JSON (proto field names) on stdout.

    cri_client.py --socket SOCK version
    cri_client.py --socket SOCK pull IMAGE [--auth-file USER_PASSWORD_FILE]
    cri_client.py --socket SOCK image-status IMAGE
    cri_client.py --socket SOCK run-pod --name N --log-dir DIR --pod-config OUT.json
    cri_client.py --socket SOCK create --pod ID --pod-config POD.json --name N \
        --image IMAGE --log-path REL [--env K=V]... -- CMD [ARG]...
    cri_client.py --socket SOCK start|status|stop|rm ID
    cri_client.py --socket SOCK stop-pod|rm-pod ID

Exit status: 0 on success, 2 on a gRPC error (code and details on stderr), 1 on a
usage or setup error.
"""

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.join(HERE, "cri.proto")


def load_messages():
    """Compile cri.proto into a temp dir and import the generated module."""
    gen = tempfile.mkdtemp(prefix="ferry-cri-")
    try:
        subprocess.run(["protoc", "-I" + HERE, "--python_out=" + gen, PROTO],
                       check=True, stderr=subprocess.PIPE)
    except FileNotFoundError:
        sys.exit("cri_client: protoc not found (Debian package protobuf-compiler)")
    except subprocess.CalledProcessError as e:
        sys.exit("cri_client: protoc failed: " + e.stderr.decode(errors="replace"))
    sys.path.insert(0, gen)
    try:
        return importlib.import_module("cri_pb2")
    finally:
        sys.path.remove(gen)
        for name in os.listdir(gen):
            os.unlink(os.path.join(gen, name))
        os.rmdir(gen)


class Cri:
    """Typed calls to one CRI endpoint; each method is one RPC."""

    def __init__(self, pb, channel, timeout):
        self.pb = pb
        self.channel = channel
        self.timeout = timeout

    def call(self, service, method, request, response_type):
        stub = self.channel.unary_unary(
            f"/runtime.v1.{service}/{method}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_type.FromString,
        )
        return stub(request, timeout=self.timeout)

    def runtime(self, method, request):
        return self.call("RuntimeService", method, request,
                         getattr(self.pb, method + "Response"))

    def image(self, method, request):
        return self.call("ImageService", method, request,
                         getattr(self.pb, method + "Response"))


def pod_config(pb, name, log_dir):
    """A host-network pod (no CNI needed): NODE network namespace. No hostname: a
    host-network pod shares the node's UTS namespace, where runc refuses to set one."""
    ns = pb.NamespaceOption(network=pb.NODE)
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, uid="ferry-e2e-" + name,
                                       namespace="ferry-e2e", attempt=0),
        log_directory=log_dir,
        labels={"app": "ferry-e2e"},
        linux=pb.LinuxPodSandboxConfig(
            security_context=pb.LinuxSandboxSecurityContext(namespace_options=ns)),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", required=True, help="CRI unix socket (containerd's)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per RPC")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("version")
    pp = sub.add_parser("pull")
    pp.add_argument("image")
    pp.add_argument("--auth-file", help="a file holding USER:PASSWORD, sent as the pull's "
                    "AuthConfig (what the kubelet sends from an image pull secret)")
    sub.add_parser("image-status").add_argument("image")
    rp = sub.add_parser("run-pod")
    rp.add_argument("--name", required=True)
    rp.add_argument("--log-dir", required=True)
    rp.add_argument("--pod-config", required=True, help="write the pod's config here")
    cc = sub.add_parser("create")
    cc.add_argument("--pod", required=True)
    cc.add_argument("--pod-config", required=True)
    cc.add_argument("--name", required=True)
    cc.add_argument("--image", required=True)
    cc.add_argument("--log-path", required=True, help="relative to the pod's log dir")
    cc.add_argument("--env", action="append", default=[])
    cc.add_argument("argv", nargs="+")
    for c in ("start", "status", "stop", "rm", "stop-pod", "rm-pod"):
        sub.add_parser(c).add_argument("id")
    a = ap.parse_args()

    pb = load_messages()
    import grpc  # noqa: E402  (after argparse, so --help works without grpcio)
    from google.protobuf import json_format

    def show(msg):
        print(json_format.MessageToJson(msg, preserving_proto_field_name=True,
                                        indent=None, sort_keys=True))

    channel = grpc.insecure_channel("unix://" + os.path.abspath(a.socket))
    cri = Cri(pb, channel, a.timeout)
    try:
        if a.cmd == "version":
            show(cri.runtime("Version", pb.VersionRequest(version="v1")))
        elif a.cmd == "pull":
            req = pb.PullImageRequest(image=pb.ImageSpec(image=a.image))
            if a.auth_file:
                with open(a.auth_file) as f:
                    user, _, password = f.read().strip().partition(":")
                req.auth.username, req.auth.password = user, password
            show(cri.image("PullImage", req))
        elif a.cmd == "image-status":
            show(cri.image("ImageStatus", pb.ImageStatusRequest(image=pb.ImageSpec(image=a.image))))
        elif a.cmd == "run-pod":
            cfg = pod_config(pb, a.name, a.log_dir)
            with open(a.pod_config, "w") as f:
                f.write(json_format.MessageToJson(cfg, preserving_proto_field_name=True))
            show(cri.runtime("RunPodSandbox", pb.RunPodSandboxRequest(config=cfg)))
        elif a.cmd == "create":
            with open(a.pod_config) as f:
                cfg = json_format.Parse(f.read(), pb.PodSandboxConfig())
            envs = []
            for kv in a.env:
                if "=" not in kv:
                    sys.exit(f"cri_client: --env {kv!r}: want KEY=VALUE")
                k, v = kv.split("=", 1)
                envs.append(pb.KeyValue(key=k, value=v))
            config = pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name=a.name, attempt=0),
                image=pb.ImageSpec(image=a.image),
                command=a.argv[:1], args=a.argv[1:], envs=envs, log_path=a.log_path)
            show(cri.runtime("CreateContainer", pb.CreateContainerRequest(
                pod_sandbox_id=a.pod, config=config, sandbox_config=cfg)))
        elif a.cmd == "start":
            show(cri.runtime("StartContainer", pb.StartContainerRequest(container_id=a.id)))
        elif a.cmd == "status":
            show(cri.runtime("ContainerStatus", pb.ContainerStatusRequest(container_id=a.id)))
        elif a.cmd == "stop":
            show(cri.runtime("StopContainer", pb.StopContainerRequest(container_id=a.id, timeout=10)))
        elif a.cmd == "rm":
            show(cri.runtime("RemoveContainer", pb.RemoveContainerRequest(container_id=a.id)))
        elif a.cmd == "stop-pod":
            show(cri.runtime("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=a.id)))
        elif a.cmd == "rm-pod":
            show(cri.runtime("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=a.id)))
    except grpc.RpcError as e:
        print(f"cri_client: {a.cmd}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    except (OSError, json_format.ParseError) as e:
        print(f"cri_client: {a.cmd}: {e}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
