"""Mutual TLS on the cluster port, with the real binary: `router`, `prefill` and `decode` processes joined
with --cluster-tls-dir (a Kubernetes TLS Secret layout made here with the openssl CLI). A decode worker with
another CA's certificate, or with none, is refused and never gets a request; completions through the TLS
cluster equal `deltaserve generate`; the cluster port speaks TLS, presents the cluster certificate and
refuses a client without one; refused peers, probes and a killed worker leave the cluster serving.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import time

import pytest

from conftest import CLUSTER_RE, DECODE_JOINED_RE, DsProcess, require_multi

OPENSSL_CNF = """[req]
distinguished_name = dn
prompt = no
[dn]
CN = deltaserve-test
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[v3_leaf]
basicConstraints = CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = DNS:localhost, IP:127.0.0.1
"""


def make_tls_secret(root: str, name: str) -> str:
    """A CA and a certificate/key it signed (server and client use), in ROOT/NAME as ca.crt, tls.crt, tls.key."""
    cnf = os.path.join(root, "openssl.cnf")
    with open(cnf, "w") as f:
        f.write(OPENSSL_CNF)
    d = os.path.join(root, name)
    os.makedirs(d)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (
        ["req", "-x509", "-config", cnf, "-extensions", "v3_ca", *ec, "-keyout", f"{d}/ca.key", "-out",
         f"{d}/ca.crt", "-days", "2", "-subj", f"/CN=test-ca-{name}"],
        ["req", "-new", "-config", cnf, *ec, "-keyout", f"{d}/tls.key", "-out", f"{d}/tls.csr", "-subj",
         f"/CN=test-node-{name}"],
        ["x509", "-req", "-in", f"{d}/tls.csr", "-CA", f"{d}/ca.crt", "-CAkey", f"{d}/ca.key", "-CAcreateserial",
         "-out", f"{d}/tls.crt", "-days", "2", "-extfile", cnf, "-extensions", "v3_leaf"],
    ):
        proc = subprocess.run(["openssl", *cmd], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"openssl {' '.join(cmd)}:\n{proc.stderr}"
    return d


@pytest.fixture
def secrets(tmp_path):
    root = str(tmp_path / "tls")
    os.makedirs(root)
    return make_tls_secret(root, "right"), make_tls_secret(root, "wrong")


def tls_client(ca_dir: str, client_dir: str | None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(os.path.join(ca_dir, "ca.crt"))
    if client_dir:
        ctx.load_cert_chain(os.path.join(client_dir, "tls.crt"), os.path.join(client_dir, "tls.key"))
    return ctx


def run_to_exit(name, args, env, logdir, timeout=120.0) -> DsProcess:
    p = DsProcess(name, args, env, logdir)
    rc = p.wait(timeout)
    assert rc is not None, f"deltaserve {name} still running after {timeout} s\n{p.describe()}"
    p.stop()
    return p


def test_cluster_tls_admits_only_the_clusters_certificates(make_cluster, reference, secrets, ds_env, logdir):
    right, wrong = secrets
    tls = ["--cluster-tls-dir", right]
    c = make_cluster("multi", router_flags=tls, prefill_flags=tls, decode_flags=tls, decode_workers=1)
    m = c.front.wait_line(CLUSTER_RE, time.monotonic() + 5)[0]
    cluster_port = int(m.group(2))
    model = ["--model", c.model_dir]

    # The cluster serves, every request on the one admitted decode worker: greedy equals `generate`.
    for prompt in ("Hello world", "The quick brown fox jumps over the lazy dog."):
        ref = reference.get(prompt, 8)
        resp = c.client().completions.create(model=c.model_id, prompt=prompt, max_tokens=8, temperature=0)
        assert resp.choices[0].text == ref["text"]
    join = ["--join", f"127.0.0.1:{cluster_port}", "--join-timeout-ms", "3000"]
    # Another CA's secret, given through the environment: the handshake fails until the join deadline.
    env = dict(ds_env, DELTASERVE_CLUSTER_TLS_DIR=wrong)
    bad = run_to_exit(f"decode-wrong-ca{c.port}", ["decode", *model, *join, "--drain-timeout-ms", "0"], env, logdir)
    assert bad.returncode == 1, bad.describe()
    assert "cannot join the registry" in bad.stderr_tail() and "over TLS" in bad.stderr_tail(), bad.describe()
    # No TLS at all: the router never answers a plain CAF handshake.
    plain = run_to_exit(f"decode-plain{c.port}", ["decode", *model, *join], ds_env, logdir)
    assert plain.returncode == 1, plain.describe()
    assert "over plain TCP" in plain.stderr_tail(), plain.describe()

    # The port speaks TLS and presents a certificate of the cluster CA (hostname 127.0.0.1 checked too).
    with socket.create_connection(("127.0.0.1", cluster_port), timeout=30) as raw:
        with tls_client(right, right).wrap_socket(raw, server_hostname="127.0.0.1") as s:
            assert s.version() in ("TLSv1.2", "TLSv1.3"), s.version()
            subject = dict(x[0] for x in s.getpeercert()["subject"])
            assert subject["commonName"] == "test-node-right", subject
    # A client without a certificate is refused by the server (TLS 1.3: an alert after the client's Finished).
    with pytest.raises((ssl.SSLError, ConnectionError)):
        with socket.create_connection(("127.0.0.1", cluster_port), timeout=30) as raw:
            with tls_client(right, None).wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.sendall(b"\0" * 16)
                if not s.recv(1):  # orderly close instead of an alert: refused as well
                    raise ConnectionError("closed by the server")
    # A client that trusts another CA does not accept the server.
    with pytest.raises(ssl.SSLCertVerificationError):
        with socket.create_connection(("127.0.0.1", cluster_port), timeout=30) as raw:
            tls_client(wrong, wrong).wrap_socket(raw, server_hostname="127.0.0.1")

    c.check_alive()
    for p in c.procs:  # the key never reaches a log or the command line
        with open(os.path.join(right, "tls.key"), "rb") as f:
            key_body = f.read().split(b"-----")[2].strip().splitlines()[0]
        for path in (p.stderr_path, p.stdout_path):
            with open(path, "rb") as f:
                assert key_body not in f.read(), f"{p.name} logged the private key"


def test_plain_cluster_port_off_loopback_needs_cluster_insecure(ds_env, logdir):
    require_multi()
    p = run_to_exit("router-open", ["router", "--port", "0", "--cluster-host", "0.0.0.0", "--cluster-port", "0"],
                    ds_env, logdir)
    assert p.returncode == 1, p.describe()
    assert "--cluster-insecure" in p.stderr_tail() and "--cluster-tls-dir" in p.stderr_tail(), p.describe()


def test_cluster_keeps_serving_through_refused_peers_probes_and_worker_churn(make_cluster, reference, secrets, ds_env,
                                                                           logdir):
    """Each TLS connection of the router is independent (the tunnel, actors/tls_tunnel.hpp): a refused worker, a
    port probe, a certificate-less client and a decode worker killed and replaced leave the cluster serving."""
    right, wrong = secrets
    tls = ["--cluster-tls-dir", right]
    c = make_cluster("multi", router_flags=tls, prefill_flags=tls, decode_flags=tls, decode_workers=1)
    cluster_port = int(c.front.wait_line(CLUSTER_RE, time.monotonic() + 5)[0].group(2))
    model = ["--model", c.model_dir]
    join = ["--join", f"127.0.0.1:{cluster_port}"]
    ref = reference.get("Hello world", 8)

    def served() -> None:
        resp = c.client(timeout=30.0).completions.create(model=c.model_id, prompt="Hello world", max_tokens=8,
                                                         temperature=0)
        assert resp.choices[0].text == ref["text"]

    served()
    env = dict(ds_env, DELTASERVE_CLUSTER_TLS_DIR=wrong)
    bad = run_to_exit(f"decode-wrong-ca-b{c.port}", ["decode", *model, *join, "--join-timeout-ms", "1000"], env, logdir)
    assert bad.returncode == 1, bad.describe()
    assert "certificate verify failed" in bad.stderr_tail(), bad.describe()
    served()

    socket.create_connection(("127.0.0.1", cluster_port), timeout=30).close()  # a TCP probe
    with pytest.raises((ssl.SSLError, ConnectionError)):  # a client without a certificate
        with socket.create_connection(("127.0.0.1", cluster_port), timeout=30) as raw:
            with tls_client(right, None).wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.sendall(b"\0" * 16)
                if not s.recv(1):
                    raise ConnectionError("closed by the server")
    served()

    # The decode worker dies without leaving (SIGKILL: its TLS connection just drops); a replacement joins.
    old = next(p for p in c.procs if "decode" in p.name)
    old.proc.kill()
    old.wait(30)
    new = DsProcess(f"multi-decode-new{c.port}", ["decode", *model, *join, *tls], ds_env, logdir)
    c.procs.append(new)  # stopped with the cluster
    deadline = time.monotonic() + 60
    while new.count_lines(DECODE_JOINED_RE) == 0 and c.front.count_lines(DECODE_JOINED_RE) < 2:
        assert new.alive(), new.describe()
        assert time.monotonic() < deadline, new.describe()
        time.sleep(0.05)
    for _ in range(3):  # the router noticed the dead worker when its connection dropped: no retries needed
        served()
    c.procs.remove(old)  # killed on purpose: not a failed stop
    c.check_alive()
