#!/usr/bin/python3
"""tests/cri/test_cri_client.py — checks for the CRI test client that need no
containerd: cri.proto's field numbers on the wire (a renumbered field would make a
real CRI server misread requests silently) and the client's method paths, JSON output
and error exit against an in-process gRPC server on a unix socket.

    /usr/bin/python3 -m unittest tests/cri/test_cri_client.py

Needs python3-grpcio, python3-protobuf and protoc (protobuf-compiler).
"""

import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cri_client  # noqa: E402

import grpc  # noqa: E402

PB = cri_client.load_messages()


class WireNumbers(unittest.TestCase):
    """Encodings computed by hand from the CRI's field numbers: tag = number << 3 | type."""

    def test_pod_sandbox_config(self):
        self.assertEqual(PB.PodSandboxConfig(log_directory="x").SerializeToString(), b"\x1a\x01x")
        self.assertEqual(PB.PodSandboxMetadata(attempt=1).SerializeToString(), b"\x20\x01")
        # linux = 8 -> security_context = 2 -> namespace_options = 1 -> network = 1 (NODE = 2)
        cfg = PB.PodSandboxConfig(linux=PB.LinuxPodSandboxConfig(
            security_context=PB.LinuxSandboxSecurityContext(
                namespace_options=PB.NamespaceOption(network=PB.NODE))))
        self.assertEqual(cfg.SerializeToString(), b"\x42\x06\x12\x04\x0a\x02\x08\x02")

    def test_container_config(self):
        self.assertEqual(PB.ContainerConfig(log_path="a").SerializeToString(), b"\x5a\x01a")
        self.assertEqual(PB.ContainerConfig(tty=True).SerializeToString(), b"\x70\x01")
        self.assertEqual(PB.ContainerConfig(args=["b"]).SerializeToString(), b"\x22\x01b")
        self.assertEqual(PB.CreateContainerRequest(pod_sandbox_id="p").SerializeToString(), b"\x0a\x01p")

    def test_status_and_images(self):
        st = PB.ContainerStatus.FromString(b"\x18\x02\x38\x07\x7a\x01l")
        self.assertEqual((st.state, st.exit_code, st.log_path), (PB.CONTAINER_EXITED, 7, "l"))
        self.assertEqual(PB.StopContainerRequest(timeout=10).SerializeToString(), b"\x10\x0a")
        self.assertEqual(PB.Image(size=5).SerializeToString(), b"\x20\x05")
        self.assertEqual(PB.PullImageRequest(auth=PB.AuthConfig(username="u")).SerializeToString(),
                         b"\x12\x03\x0a\x01u")

    def test_unknown_fields_are_skipped(self):
        # a real server sends fields this subset does not declare (e.g. image_id = 17)
        st = PB.ContainerStatus.FromString(b"\x8a\x01\x01z\x38\x03")
        self.assertEqual(st.exit_code, 3)


class AgainstFakeServer(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.sock = os.path.join(self.dir.name, "cri.sock")
        self.seen = []

        def version(req, ctx):
            self.seen.append(("Version", req.version))
            return PB.VersionResponse(version="0.1.0", runtime_name="fake",
                                      runtime_version="1", runtime_api_version="v1")

        def create(req, ctx):
            self.seen.append(("CreateContainer", req))
            return PB.CreateContainerResponse(container_id="c1")

        def stop(req, ctx):
            ctx.abort(grpc.StatusCode.NOT_FOUND, "no such container")

        def h(fn, req_type, resp_type):
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=req_type.FromString,
                response_serializer=resp_type.SerializeToString)

        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "runtime.v1.RuntimeService", {
                "Version": h(version, PB.VersionRequest, PB.VersionResponse),
                "CreateContainer": h(create, PB.CreateContainerRequest, PB.CreateContainerResponse),
                "StopContainer": h(stop, PB.StopContainerRequest, PB.StopContainerResponse),
            }),))
        self.server.add_insecure_port("unix://" + self.sock)
        self.server.start()

    def tearDown(self):
        self.server.stop(None)
        self.dir.cleanup()

    def run_client(self, *args):
        return subprocess.run([sys.executable, os.path.join(HERE, "cri_client.py"),
                               "--socket", self.sock, "--timeout", "10", *args],
                              capture_output=True, text=True, timeout=60)

    def test_version(self):
        r = self.run_client("version")
        self.assertEqual(r.returncode, 0, r.stderr)
        out = json.loads(r.stdout)
        self.assertEqual(out["runtime_api_version"], "v1")
        self.assertEqual(out["runtime_name"], "fake")
        self.assertEqual(self.seen, [("Version", "v1")])

    def test_create_sends_pod_config_and_command(self):
        pod = os.path.join(self.dir.name, "pod.json")
        cfg = cri_client.pod_config(PB, "p", "/logs")
        from google.protobuf import json_format
        with open(pod, "w") as f:
            f.write(json_format.MessageToJson(cfg))
        r = self.run_client("create", "--pod", "pod1", "--pod-config", pod, "--name", "app",
                            "--image", "reg/x:1", "--log-path", "app.log", "--env", "A=b=c",
                            "--", "/bin/sh", "-c", "echo hi")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(json.loads(r.stdout), {"container_id": "c1"})
        (name, req), = self.seen
        self.assertEqual(req.pod_sandbox_id, "pod1")
        self.assertEqual(list(req.config.command), ["/bin/sh"])
        self.assertEqual(list(req.config.args), ["-c", "echo hi"])
        self.assertEqual([(e.key, e.value) for e in req.config.envs], [("A", "b=c")])
        self.assertEqual(req.config.image.image, "reg/x:1")
        self.assertEqual(req.sandbox_config.log_directory, "/logs")
        self.assertEqual(req.sandbox_config.linux.security_context.namespace_options.network, PB.NODE)

    def test_rpc_error_exit_2(self):
        r = self.run_client("stop", "nope")
        self.assertEqual(r.returncode, 2)
        self.assertIn("NOT_FOUND", r.stderr)
        self.assertIn("no such container", r.stderr)

    def test_unimplemented_method_is_an_error(self):
        r = self.run_client("start", "c1")
        self.assertEqual(r.returncode, 2)
        self.assertIn("UNIMPLEMENTED", r.stderr)


if __name__ == "__main__":
    unittest.main()
