"""TLS on every listener, link and the HTTP port, with certificates the tests make
(``trustme``): mutual TLS, rotation without a restart, each error a user meets (one line,
never a hang), and a proxy that shows no capability or payload crosses in clear."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import re
import signal
import ssl
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from broker_support import PY, TIMEOUT, Changes, async_test, kill, read_line_matching
from dataspace.broker import Server, ServerConfig
from dataspace.broker.config import ConfigError, parse_config
from dataspace.client import connect
from dataspace.net.address import Address, AddressError, parse_address
from dataspace.net.tls import ClientTLS, TLSConfigError, cert_info, read_certificate
from dataspace.values import parse

SCRIPT = os.path.join(os.path.dirname(__file__), "interop_syndicate_client.py")
FAIL_WITHIN = 15.0
"""Seconds within which every failure must have been reported (none hangs)."""


# ---------------------------------------------------------------------------------------
# Certificates


@dataclass
class Pki:
    dir: Path
    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_client_cert: Path
    other_client_key: Path
    expired_cert: Path
    expired_key: Path
    named_cert: Path  # valid for example.com only
    named_key: Path
    authority: trustme.CA

    def issue(self, name: str, *identities: str) -> tuple[Path, Path]:
        """Another server certificate from the same CA (for rotation)."""
        c = self.authority.issue_cert(*(identities or ("127.0.0.1", "localhost")),
                                      common_name=name)
        cert, key = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        c.cert_chain_pems[0].write_to_path(str(cert))
        c.private_key_pem.write_to_path(str(key))
        return cert, key


def _write(c: trustme.LeafCert, d: Path, name: str) -> tuple[Path, Path]:
    cert, key = d / f"{name}.crt", d / f"{name}.key"
    c.cert_chain_pems[0].write_to_path(str(cert))
    c.private_key_pem.write_to_path(str(key))
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA(organization_name="Dataspace Test CA")
    other = trustme.CA(organization_name="Another CA")
    ca.cert_pem.write_to_path(str(d / "ca.crt"))
    other.cert_pem.write_to_path(str(d / "other-ca.crt"))
    cert, key = _write(ca.issue_cert("127.0.0.1", "localhost", common_name="server one"),
                       d, "server")
    ccert, ckey = _write(ca.issue_cert("alice@example.org", common_name="alice"), d, "client")
    ocert, okey = _write(other.issue_cert("mallory@example.org", common_name="mallory"),
                         d, "other-client")
    ecert, ekey = _write(ca.issue_cert(
        "127.0.0.1", common_name="old server", not_before=datetime.datetime(2020, 1, 1),
        not_after=datetime.datetime(2021, 1, 1)), d, "expired")
    ncert, nkey = _write(ca.issue_cert("example.com", common_name="example.com"), d, "named")
    return Pki(d, d / "ca.crt", cert, key, ccert, ckey, d / "other-ca.crt", ocert, okey,
               ecert, ekey, ncert, nkey, ca)


@contextlib.asynccontextmanager
async def tls_server(tmp_path: Path, pki: Pki, **settings):
    settings.setdefault("tcp", ["127.0.0.1:0"])
    settings.setdefault("tls_cert", str(pki.cert))
    settings.setdefault("tls_key", str(pki.key))
    server = Server(ServerConfig(**settings), data_dir=tmp_path / "data")
    await server.start()
    try:
        yield server
    finally:
        await server.close()


def address(server: Server, kind: str) -> str:
    return str(next(a for a in server.addresses if a.kind == kind))


async def served_cn(host: str, port: int, ca: Path) -> str:
    """The common name of the certificate the server at host:port presents now."""
    ctx = ssl.create_default_context(cafile=str(ca))
    _r, w = await asyncio.open_connection(host, port, ssl=ctx)
    try:
        cert = w.get_extra_info("peercert")
        return next(v for rdn in cert["subject"] for k, v in rdn if k == "commonName")
    finally:
        w.close()


async def fails(coro, *, within: float = FAIL_WITHIN) -> str:
    """The one-line message ``coro`` fails with, within ``within`` seconds."""
    try:
        await asyncio.wait_for(coro, within)
    except (ConnectionError, TLSConfigError) as e:
        msg = str(e)
        assert msg and "\n" not in msg, msg
        return msg
    raise AssertionError("did not fail")


# ---------------------------------------------------------------------------------------
# Addresses and certificates


def test_addresses_with_tls():
    assert parse_address("tls://127.0.0.1:7411") == Address("tls", "127.0.0.1", 7411)
    assert str(parse_address("tls://[::1]:7411")) == "tls://[::1]:7411"
    a = parse_address("wss://example.org/ds")
    assert (a.kind, a.port, a.path, a.secure, a.websocket) == ("wss", 443, "/ds", True, True)
    assert a.url == "wss://example.org:443/ds"
    assert parse_address("tls://0.0.0.0:7412", default_kind="ws").kind == "wss"
    assert parse_address('<ws "wss://h:1/x">').kind == "wss"
    assert not parse_address("h:1").secure
    with pytest.raises(AddressError, match="http:// is not a server address"):
        parse_address("http://h:1")


def test_certificate_description(pki: Pki):
    info = read_certificate(pki.cert)
    assert info is not None
    assert info.subject == "CN=server one"
    assert info.issuer.startswith("O=Dataspace Test CA")
    assert info.names == ("IP:127.0.0.1", "DNS:localhost")
    assert info.not_after is not None and not info.expired()
    old = read_certificate(pki.expired_cert)
    assert old is not None and old.expired() and old.not_after.year == 2021
    assert cert_info(b"\x30\x82\xff\xff garbage") is None
    assert cert_info(b"") is None


# ---------------------------------------------------------------------------------------
# Listeners


@async_test
async def test_tcp_and_websocket_listeners_speak_tls(tmp_path, pki):
    async with tls_server(tmp_path, pki, ws=["127.0.0.1:0"],
                          unix=[str(tmp_path / "ds.sock")]) as server:
        kinds = sorted(a.kind for a in server.addresses)
        assert kinds == ["tls", "unix", "wss"]  # Unix sockets stay local and plain
        over_tls = await connect(address(server, "tls"), server.sturdyref, tls_ca=str(pki.ca))
        over_wss = await connect(address(server, "wss"), server.sturdyref, tls_ca=str(pki.ca))
        over_unix = await connect(f"unix:{tmp_path / 'ds.sock'}", server.sturdyref)
        seen = Changes()
        over_wss.observe("<Says $who $what>", **seen.kw())
        await over_wss.sync()
        over_tls.send(parse('<Says "tls" "hi">'))
        over_unix.send(parse('<Says "unix" "hi">'))
        await seen.until(lambda s: {("tls", "hi"), ("unix", "hi")} <= set(s.messages()))
        from dataspace.web.broker import connection_row

        assert sorted(connection_row(server, c)["transport"] for c in server.connections) == \
            ["tls", "unix", "wss"]
        for c in (over_tls, over_wss, over_unix):
            await c.close()


@async_test
async def test_tls_listener_given_as_tls_address_and_the_environment(tmp_path, pki, monkeypatch):
    # tls:// in --tcp is the same listener; DATASPACE_SERVER and DATASPACE_TLS_CA are used
    # by a client given neither.
    async with tls_server(tmp_path, pki, tcp=["tls://127.0.0.1:0"]) as server:
        monkeypatch.setenv("DATASPACE_SERVER", address(server, "tls"))
        monkeypatch.setenv("DATASPACE_TLS_CA", str(pki.ca))
        ds = await connect(None, server.sturdyref)
        await ds.sync()
        await ds.close()
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        ds = await connect(address(server, "tls"), server.sturdyref, ssl=ctx)
        await ds.sync()
        await ds.close()


@async_test
async def test_a_client_that_never_completes_the_handshake_is_closed(tmp_path, pki, monkeypatch):
    import dataspace.broker.server as server_module

    monkeypatch.setattr(server_module, "HANDSHAKE_TIMEOUT", 0.5)
    async with tls_server(tmp_path, pki) as server:
        a = parse_address(address(server, "tls"))
        r, w = await asyncio.open_connection(a.host, a.port)
        assert await asyncio.wait_for(r.read(), FAIL_WITHIN) == b""  # closed, not held
        w.close()


# ---------------------------------------------------------------------------------------
# Mutual TLS


@async_test
async def test_mutual_tls(tmp_path, pki):
    async with tls_server(tmp_path, pki, ws=["127.0.0.1:0"],
                          tls_client_ca=str(pki.ca)) as server:
        assert server.tls is not None and server.tls.mutual
        for kind in ("tls", "wss"):
            where = address(server, kind)
            ds = await connect(where, server.sturdyref, tls_ca=str(pki.ca),
                               tls_cert=str(pki.client_cert), tls_key=str(pki.client_key))
            await ds.sync()
            await ds.close()
            msg = await fails(connect(where, server.sturdyref, tls_ca=str(pki.ca),
                                      reconnect=False))
            assert "asks for a client certificate: pass --tls-cert FILE and --tls-key FILE" in msg
            msg = await fails(connect(where, server.sturdyref, tls_ca=str(pki.ca),
                                      tls_cert=str(pki.other_client_cert),
                                      tls_key=str(pki.other_client_key), reconnect=False))
            assert f"did not accept the client certificate {pki.other_client_cert}" in msg
        assert not server.connections


# ---------------------------------------------------------------------------------------
# Errors a user meets: one line each, none hangs


@async_test
async def test_plain_and_tls_mismatched(tmp_path, pki):
    async with tls_server(tmp_path, pki, ws=["127.0.0.1:0"]) as server:
        tls_at = parse_address(address(server, "tls"))
        wss_at = parse_address(address(server, "wss"))
        msg = await fails(connect(tls_at.host_port, server.sturdyref, reconnect=False))
        assert msg == (f"the server at {tls_at.host_port} speaks TLS: use tls://"
                       f"{tls_at.host_port} (with --tls-ca FILE if its certificate is not "
                       "from a CA in the system's trust store)")
        msg = await fails(connect(f"ws://{wss_at.host_port}/", server.sturdyref,
                                  reconnect=False))
        assert f"speaks TLS: use wss://{wss_at.host_port}/" in msg
    plain = Server(ServerConfig(tcp=["127.0.0.1:0"], ws=["127.0.0.1:0"]),
                   data_dir=tmp_path / "plain")
    await plain.start()
    try:
        tcp = next(a for a in plain.addresses if a.kind == "tcp")
        ws = next(a for a in plain.addresses if a.kind == "ws")
        msg = await fails(connect(f"tls://{tcp.host_port}", plain.sturdyref,
                                  tls_ca=str(pki.ca), reconnect=False))
        assert msg == (f"the server at {tcp.host_port} does not speak TLS: use "
                       f"{tcp.host_port} (without tls://), or start it with --tls-cert and "
                       "--tls-key")
        msg = await fails(connect(f"wss://{ws.host_port}/", plain.sturdyref,
                                  tls_ca=str(pki.ca), reconnect=False))
        assert f"does not speak TLS: use ws://{ws.host_port}/ (without wss://)" in msg
    finally:
        await plain.close()


@async_test
async def test_certificate_not_trusted(tmp_path, pki, monkeypatch):
    monkeypatch.delenv("DATASPACE_TLS_CA", raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    async with tls_server(tmp_path, pki, ws=["127.0.0.1:0"]) as server:
        where = address(server, "tls")
        hp = parse_address(where).host_port
        msg = await fails(connect(where, server.sturdyref, tls_ca=str(pki.other_ca),
                                  reconnect=False))
        assert msg.startswith("the server's certificate (CN=server one, issued by "
                              "O=Dataspace Test CA")
        assert f"at {hp} is not signed by a CA in the CA file {pki.other_ca}: pass --tls-ca " \
               "with the CA that signed it" in msg
        msg = await fails(connect(where, server.sturdyref, reconnect=False))
        assert "is not signed by a CA in the system's trust store: pass --tls-ca" in msg
        msg = await fails(connect(address(server, "wss"), server.sturdyref,
                                  tls_ca=str(pki.other_ca), reconnect=False))
        assert "(CN=server one" in msg and f"in the CA file {pki.other_ca}" in msg
        # Insecure, and saying so: no check at all.
        ds = await connect(where, server.sturdyref, tls_insecure_skip_verify=True)
        await ds.sync()
        await ds.close()


@async_test
async def test_name_mismatch_and_expired(tmp_path, pki):
    async with tls_server(tmp_path, pki, tls_cert=str(pki.named_cert),
                          tls_key=str(pki.named_key)) as server:
        where = address(server, "tls")
        msg = await fails(connect(where, server.sturdyref, tls_ca=str(pki.ca),
                                  reconnect=False))
        assert msg.startswith("the server's certificate (CN=example.com, issued by ")
        assert "is not valid for 127.0.0.1 (it names DNS:example.com): connect with a name " \
               "the certificate has" in msg
        # The name it has, checked while connecting to the address.
        ds = await connect(where, server.sturdyref, tls_ca=str(pki.ca),
                           tls_server_name="example.com")
        await ds.sync()
        await ds.close()
    async with tls_server(tmp_path, pki, tls_cert=str(pki.expired_cert),
                          tls_key=str(pki.expired_key)) as server:
        msg = await fails(connect(address(server, "tls"), server.sturdyref,
                                  tls_ca=str(pki.ca), reconnect=False))
        assert "(CN=old server, issued by" in msg
        assert "expired on 2021-01-01 00:00 UTC: the server's operator must renew it" in msg


@async_test
async def test_server_files_that_cannot_be_used(tmp_path, pki):
    other_key = pki.dir / "other-client.key"
    encrypted = tmp_path / "encrypted.key"
    _encrypt(pki.key, encrypted)
    cases = [
        ({"tls_key": str(other_key)},
         f"the server key {other_key} does not match the server certificate {pki.cert}: "
         "give the key the certificate was made with"),
        ({"tls_cert": str(tmp_path / "missing.crt")},
         f"cannot read the server certificate {tmp_path / 'missing.crt'}: the file does not "
         "exist"),
        ({"tls_cert": str(tmp_path)},
         f"cannot read the server certificate {tmp_path}: it is a directory, not a file"),
        ({"tls_cert": str(pki.key)},
         f"the server certificate {pki.key} holds no PEM certificate"),
        ({"tls_key": str(pki.cert)}, f"the server key {pki.cert} holds no PEM private key"),
        ({"tls_key": str(encrypted)},
         f"the server key {encrypted} is encrypted with a passphrase: decrypt it"),
        ({"tls_client_ca": str(tmp_path / "nope.crt")},
         f"cannot read the client CA file {tmp_path / 'nope.crt'}: the file does not exist"),
    ]
    for settings, message in cases:
        server = Server(ServerConfig(**{"tcp": ["127.0.0.1:0"], "tls_cert": str(pki.cert),
                                        "tls_key": str(pki.key), **settings}),
                        data_dir=tmp_path / "data")
        with pytest.raises(ConfigError) as e:
            await asyncio.wait_for(server.start(), FAIL_WITHIN)
        assert message in str(e.value) and "\n" not in str(e.value)
        assert not server.addresses
    for settings, message in [
        ({"tls_cert": str(pki.cert)}, "tls-cert needs its key: give --tls-key FILE too"),
        ({"tls_key": str(pki.key)}, "tls-key and tls-client-ca go with tls-cert"),
        ({"tcp": ["tls://127.0.0.1:0"]}, "a tls:// or wss:// listener needs a certificate"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            ServerConfig(**settings).check()


def _encrypt(key: Path, out: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    k = serialization.load_pem_private_key(key.read_bytes(), password=None)
    out.write_bytes(k.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.BestAvailableEncryption(b"secret")))


@async_test
async def test_client_files_that_cannot_be_used(tmp_path, pki):
    async with tls_server(tmp_path, pki) as server:
        where = address(server, "tls")
        msg = await fails(connect(where, server.sturdyref, tls_ca=str(tmp_path / "ca.pem")))
        assert msg == f"cannot read the CA file {tmp_path / 'ca.pem'}: the file does not exist"
        msg = await fails(connect(where, server.sturdyref, tls_ca=str(pki.ca),
                                  tls_cert=str(pki.client_cert), tls_key=str(pki.key)))
        assert msg.startswith(f"the client key {pki.key} does not match the client "
                              f"certificate {pki.client_cert}")
        # A certificate without --tls-key: say to give the key (it once said the
        # certificate "holds no PEM private key", which reads as a broken file).
        msg = await fails(connect(where, server.sturdyref, tls_ca=str(pki.ca),
                                  tls_cert=str(pki.client_cert)))
        assert msg == (f"the client certificate {pki.client_cert} comes without its key: "
                       "give the key it was made with too (--tls-key FILE)")
        msg = await fails(connect(parse_address(where).host_port, server.sturdyref,
                                  tls_ca=str(pki.ca)))
        assert "TLS options were given for" in msg and "write tls://" in msg


# ---------------------------------------------------------------------------------------
# Rotation


@async_test
async def test_certificate_rotation_without_restart(tmp_path, pki, caplog):
    cert, key = tmp_path / "live.crt", tmp_path / "live.key"

    def install(name: str, *, key_too: bool = True) -> None:
        c, k = pki.issue(name)
        os.replace(c, cert)  # as a renewal tool does: the new file replaces the old
        if key_too:
            os.replace(k, key)

    install("first")
    async with tls_server(tmp_path, pki, tls_cert=str(cert), tls_key=str(key)) as server:
        a = parse_address(address(server, "tls"))
        assert await served_cn(a.host, a.port, pki.ca) == "first"
        old = await connect(str(a), server.sturdyref, tls_ca=str(pki.ca))
        await old.sync()

        # SIGHUP's work: the new certificate for new connections, old ones untouched.
        install("second")
        info = server.reload_tls()
        assert info is not None and info.subject == "CN=second"
        assert await served_cn(a.host, a.port, pki.ca) == "second"
        await old.sync()
        assert old.reconnects == 0

        # Without a signal: the files' change is seen at the next handshake.
        install("third")
        assert await served_cn(a.host, a.port, pki.ca) == "third"

        # Half a renewal (a certificate without its key) is not served: the previous
        # one stays, with a warning, until the key arrives.
        c4, k4 = pki.issue("fourth")
        os.replace(c4, cert)
        with caplog.at_level(logging.WARNING, logger="dataspace.net.tls"):
            assert await served_cn(a.host, a.port, pki.ca) == "third"
        assert any("does not match" in r.getMessage() and "still serving the previous"
                   in r.getMessage() for r in caplog.records)
        with pytest.raises(TLSConfigError, match="does not match"):
            server.reload_tls()
        os.replace(k4, key)
        assert await served_cn(a.host, a.port, pki.ca) == "fourth"
        await old.sync()
        await old.close()


# ---------------------------------------------------------------------------------------
# Links and the HTTP port


@async_test
async def test_links_over_tls_with_mutual_tls(tmp_path, pki):
    upstream_cert, upstream_key = pki.issue("upstream")
    down_cert, down_key = pki.issue("downstream")
    async with tls_server(tmp_path / "up", pki, tls_cert=str(upstream_cert),
                          tls_key=str(upstream_key), tls_client_ca=str(pki.ca)) as up:
        where = address(up, "tls")
        # The link trusts the CA (tls-ca) and shows the downstream server's own
        # certificate to the upstream, which asks for one.
        async with tls_server(tmp_path / "down", pki, tls_cert=str(down_cert),
                              tls_key=str(down_key), tls_ca=str(pki.ca),
                              link=[(where, str(up.sturdyref))]) as down:
            near = await connect(address(down, "tls"), down.sturdyref, tls_ca=str(pki.ca))
            far = await connect(where, up.sturdyref, tls_ca=str(pki.ca),
                                tls_cert=str(pki.client_cert), tls_key=str(pki.client_key))
            seen = Changes()
            near.observe("<Says $who $what>", **seen.kw())
            await near.sync()
            for _ in range(200):  # the link upstreams the subscription, then delivers
                far.send(parse('<Says "far" "over the link">'))
                await far.sync()
                with contextlib.suppress(TimeoutError):
                    await seen.until(lambda s: bool(s.messages()), timeout=0.1)
                if seen.messages():
                    break
            assert ("far", "over the link") in seen.messages()
            await near.close()
            await far.close()
        # A link that does not trust the CA says why in its status.
        async with tls_server(tmp_path / "bad", pki,
                              link=[(where, str(up.sturdyref), {"tls-ca": str(pki.other_ca)})]
                              ) as bad:
            hub = bad.links["root"]

            async def reason() -> str:
                while where not in hub.last_error:
                    await asyncio.sleep(0.05)
                return hub.last_error[where]

            msg = await asyncio.wait_for(reason(), FAIL_WITHIN)
            assert "is not signed by a CA in the CA file" in msg and str(pki.other_ca) in msg


@async_test
async def test_a_plain_link_to_tls_members_says_use_tls(tmp_path, pki):
    """A link given several addresses (a cluster's members) without tls:// to servers that
    speak TLS says so for the address it dialed, not "connection closed by the peer"
    (the explanation was asked of the whole list parsed as one address)."""
    async with tls_server(tmp_path / "a", pki) as a, tls_server(tmp_path / "b", pki) as b:
        first, second = (parse_address(address(s, "tls")).host_port for s in (a, b))
        spec = f"{first},{second}"
        async with tls_server(tmp_path / "plain", pki, tls_cert=None, tls_key=None,
                              link=[(spec, str(a.sturdyref))]) as plain:
            hub = plain.links["root"]
            changed = asyncio.Event()
            hub.on_change.append(changed.set)

            async def reason() -> str:
                while "speaks TLS" not in hub.last_error.get(spec, ""):
                    changed.clear()
                    await changed.wait()
                return hub.last_error[spec]

            msg = await asyncio.wait_for(reason(), FAIL_WITHIN)
            assert "connection closed by the peer" not in msg
            assert re.search(rf"the server at ({re.escape(first)}|{re.escape(second)}) speaks "
                             rf"TLS: use tls://({re.escape(first)}|{re.escape(second)})", msg), msg


def _rewrite_unseen(path: Path, source: Path, size: int = 16384) -> None:
    """Put ``source``'s content in ``path`` so that a look at the file (its size,
    modification time and inode: what a handshake's check compares) sees no change: the
    same inode written in place, padded (blank lines, which PEM readers skip) to the same
    size, its modification time put back."""
    data = source.read_bytes()
    assert len(data) < size
    st = path.stat()
    with open(path, "r+b") as f:
        f.write(data + b"\n" * (size - len(data)))
        f.truncate()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns,
                                                               st.st_ino)


@async_test
async def test_sighup_reloads_the_cluster_ports_and_the_routes_certificate(tmp_path, pki):
    """SIGHUP's reload (Server.reload_tls) reaches the cluster port and the routes this
    member dials, not only the client listeners: a member renewed in a way the
    handshake's look at the files cannot see serves and shows the new certificate from
    the reload on (the cluster port had a TLS of its own that only that look reloaded,
    and the certificate shown when dialing was never reloaded)."""
    from dataspace.broker.cluster import make_secret

    cert, key = tmp_path / "live.crt", tmp_path / "live.key"
    first, second = pki.issue("member first"), pki.issue("member second")
    cert.write_bytes(first[0].read_bytes().ljust(16384, b"\n"))
    key.write_bytes(first[1].read_bytes().ljust(16384, b"\n"))
    secret = tmp_path / "cluster.secret"
    secret.write_text(make_secret())
    secret.chmod(0o600)
    # A member this one dials (its seed), asking for a client certificate: it says which
    # one each dial showed, and closes.
    shown: asyncio.Queue[str] = asyncio.Queue()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca))
    ctx.load_cert_chain(str(pki.cert), str(pki.key))
    ctx.verify_mode = ssl.CERT_REQUIRED

    async def dialed(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        subject = w.get_extra_info("peercert")["subject"]
        shown.put_nowait(next(v for rdn in subject for k, v in rdn if k == "commonName"))
        w.close()

    seed = await asyncio.start_server(dialed, "127.0.0.1", 0, ssl=ctx)
    seed_port = seed.sockets[0].getsockname()[1]

    async def next_shown(name: str) -> None:
        while await asyncio.wait_for(shown.get(), FAIL_WITHIN) != name:
            pass

    try:
        async with tls_server(tmp_path, pki, tls_cert=str(cert), tls_key=str(key),
                              tls_ca=str(pki.ca), cluster="127.0.0.1:0",
                              cluster_secret=str(secret), routes=[f"127.0.0.1:{seed_port}"]
                              ) as server:
            assert server.cluster is not None
            host, port = server.cluster.address.rsplit(":", 1)
            a = parse_address(address(server, "tls"))
            assert await served_cn(host, int(port), pki.ca) == "member first"
            await next_shown("member first")

            _rewrite_unseen(cert, second[0])
            _rewrite_unseen(key, second[1])
            assert await served_cn(host, int(port), pki.ca) == "member first"  # (unseen)
            info = server.reload_tls()
            assert info is not None and info.subject == "CN=member second"
            assert await served_cn(a.host, a.port, pki.ca) == "member second"
            assert await served_cn(host, int(port), pki.ca) == "member second"
            await next_shown("member second")
    finally:
        seed.close()


@async_test
async def test_a_flood_of_idle_tls_clients_is_one_warning(tmp_path, pki, caplog):
    """100 clients that finish the TLS handshake and resolve nothing: the server closes
    each after --handshake-timeout, with one warning for the cause (the rest at DEBUG,
    then a count a minute), not a warning each."""
    caplog.set_level(logging.DEBUG, logger="dataspace")
    async with tls_server(tmp_path, pki, handshake_timeout=0.3, connect_rate=0.0) as server:
        host, port = parse_address(address(server, "tls")).host_port.rsplit(":", 1)
        ctx = ssl.create_default_context(cafile=str(pki.ca))

        async def idle_client() -> bytes:
            r, w = await asyncio.open_connection(host, int(port), ssl=ctx)
            try:
                return await r.read()  # until the server closes it
            finally:
                w.close()

        closed = await asyncio.wait_for(asyncio.gather(*(idle_client() for _ in range(100))),
                                        60.0)
        assert all(b"handshake-timeout" in c for c in closed)  # each told why
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([m for m in said if "no sturdyref resolved" in m]) == 1, said
    closing = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG
               and r.getMessage().endswith(": closing: no sturdyref resolved within 0.3 s")]
    assert len(set(closing)) == 100  # each still said, at DEBUG ...
    assert len(closing) == 100, closing  # ... once (it was twice: the counter, the close)


@async_test
async def test_idle_clients_closed_for_idleness_are_one_warning(tmp_path, pki, caplog):
    """20 clients that resolve their capability and then hold and send nothing: each is
    closed after --idle-timeout, with one warning for the cause, not one each."""
    caplog.set_level(logging.DEBUG, logger="dataspace")
    async with tls_server(tmp_path, pki, idle_timeout=0.3, connect_rate=0.0) as server:
        clients = [await connect(address(server, "tls"), server.sturdyref, tls_ca=str(pki.ca),
                                 reconnect=False) for _ in range(20)]
        await asyncio.wait_for(asyncio.gather(*(c.wait_closed() for c in clients)), 30.0)
    said = [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("dataspace")]
    assert len([m for m in said if "idle: the connection held nothing" in m]) == 1, said


def test_counted_warnings_say_a_cause_once_then_a_count_a_minute(caplog):
    from dataspace.broker.cluster import SAY_AGAIN, CountedWarnings

    said = CountedWarnings(logging.getLogger("test.counted"))
    with caplog.at_level(logging.DEBUG, logger="test.counted"):
        for i in range(100):
            said.say("timeout", f"closing {i}", i * 0.5)  # 100 in 50 s
        said.say("other", "another cause", 50.0)
        said.say("timeout", "closing 100", SAY_AGAIN + 1.0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["closing 0", "another cause",
                        f"closing 100 (99 more like it in the last {SAY_AGAIN + 1:.0f} s)"]
    assert len(caplog.records) == 102


def test_link_tls_settings_in_the_config_file(pki):
    cfg = parse_config(f'''{{
        tls-cert: "{pki.cert}" tls-key: "{pki.key}" tls-ca: "{pki.ca}"
        link: [{{address: "tls://127.0.0.1:1" cap: "<ref {{oid: \\"root\\" sig: #[AAAAAAAAAAAAAAAAAAAAAA==]}}>"
                 tls-ca: "{pki.other_ca}" tls-server-name: "peer.example"}}
               {{address: "tls://127.0.0.1:2" cap: "<ref {{oid: \\"root\\" sig: #[AAAAAAAAAAAAAAAAAAAAAA==]}}>"}}]
    }}''')
    first, second = cfg.link_specs()
    assert first.tls == ClientTLS(ca=str(pki.other_ca), cert=str(pki.cert), key=str(pki.key),
                                  server_name="peer.example")
    assert second.tls is not None and second.tls.ca == str(pki.ca)
    with pytest.raises(ConfigError, match="TLS settings for an address without TLS"):
        parse_config('{link: [{address: "127.0.0.1:1" cap: "<ref {oid: \\"root\\" sig: '
                     '#[AAAAAAAAAAAAAAAAAAAAAA==]}>" tls-ca: "x"}]}')
    with pytest.raises(ConfigError, match="cannot read the CA file"):
        parse_config('{link: [{address: "tls://127.0.0.1:1" cap: "<ref {oid: \\"root\\" sig: '
                     '#[AAAAAAAAAAAAAAAAAAAAAA==]}>" tls-ca: "/nonexistent/ca.crt"}]}')


@async_test
async def test_https_port(tmp_path, pki):
    from dataspace.web import start_http

    cert, key = tmp_path / "live.crt", tmp_path / "live.key"
    c, k = pki.issue("first")
    os.replace(c, cert)
    os.replace(k, key)
    # Mutual TLS is for the protocol's listeners: the HTTP port asks for no client
    # certificate (its tokens are its access control).
    async with tls_server(tmp_path, pki, tls_cert=str(cert), tls_key=str(key),
                          tls_client_ca=str(pki.ca)) as server:
        assert server.tls is not None
        http = await start_http("127.0.0.1", 0, store=None, publish=[], server=server,
                                ssl_context=server.tls.http_context)
        try:
            assert http.url.startswith("https://127.0.0.1:")
            ctx = ssl.create_default_context(cafile=str(pki.ca))

            def get(path: str, token: str | None = None) -> tuple[int, bytes]:
                req = urllib.request.Request(http.url + path)
                if token:
                    req.add_header("Authorization", f"Bearer {token}")
                with urllib.request.urlopen(req, timeout=TIMEOUT, context=ctx) as r:
                    return r.status, r.read()

            status, body = await asyncio.to_thread(get, "api/server", str(server.sturdyref))
            assert status == 200 and json.loads(body)["connections"] == 0
            # The connections page says which are over TLS.
            ds = await connect(address(server, "tls"), server.sturdyref, tls_ca=str(pki.ca),
                               tls_cert=str(pki.client_cert), tls_key=str(pki.client_key))
            status, body = await asyncio.to_thread(get, "api/connections", str(server.sturdyref))
            assert [c["transport"] for c in json.loads(body)["connections"]] == ["tls"]
            await ds.close()
            status, body = await asyncio.to_thread(get, "")
            assert status == 200 and b"<html" in body.lower()  # the inspector
            # A rotated certificate reaches the HTTP port too: it shares the context.
            c, k = pki.issue("rotated")
            os.replace(c, cert)
            os.replace(k, key)
            server.reload_tls()
            assert await served_cn("127.0.0.1", http.port, pki.ca) == "rotated"
            assert (await asyncio.to_thread(get, "healthz"))[0] == 200
        finally:
            await http.close()


# ---------------------------------------------------------------------------------------
# Nothing in clear: a proxy between client and server records every byte


class RecordingProxy:
    """A TCP proxy on loopback that keeps every byte that crosses it, both ways."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.recorded = bytearray()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> RecordingProxy:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(*self.target)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    self.recorded += data
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pipe(r, uw), pipe(ur, w))

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()


MARKER = "payload-marker-5e0b7a91c3"


async def _through_proxy(server: Server, kind: str, **tls) -> bytes:
    a = parse_address(address(server, kind))
    proxy = await RecordingProxy((a.host, a.port)).start()
    try:
        via = Address(a.kind, "127.0.0.1", proxy.port, a.path)
        sender = await connect(str(via), server.sturdyref, **tls)
        receiver = await connect(str(via), server.sturdyref, **tls)
        seen = Changes()
        receiver.observe("<Secret $text>", **seen.kw())
        await receiver.sync()
        sender.send(parse(f'<Secret "{MARKER}">'))
        await seen.until(lambda s: (MARKER,) in s.messages())
        await sender.close()
        await receiver.close()
    finally:
        await proxy.close()
    return bytes(proxy.recorded)


@async_test
async def test_no_capability_or_payload_crosses_in_clear(tmp_path, pki):
    secrets = lambda ref: [ref.sig, MARKER.encode()]  # noqa: E731
    async with tls_server(tmp_path, pki, ws=["127.0.0.1:0"]) as server:
        for kind in ("tls", "wss"):
            seen = await _through_proxy(server, kind, tls_ca=str(pki.ca))
            assert len(seen) > 1000  # the proxy did carry the conversation
            for s in secrets(server.sturdyref):
                assert s not in seen, f"{s!r} crossed the proxy in clear over {kind}"
    # The same proxy in front of a plain server sees both: the test can fail.
    plain = Server(ServerConfig(tcp=["127.0.0.1:0"], ws=["127.0.0.1:0"]),
                   data_dir=tmp_path / "plain")
    await plain.start()
    try:
        seen = await _through_proxy(plain, "tcp")
        for s in secrets(plain.sturdyref):
            assert s in seen
        # Over ws:// a client's frames are masked (XOR with a key sent beside them: no
        # secrecy), so the server's side shows it: the payload comes back unmasked.
        assert MARKER.encode() in await _through_proxy(plain, "ws")
    finally:
        await plain.close()


@async_test
async def test_the_http_token_does_not_cross_in_clear(tmp_path, pki):
    from dataspace.web import start_http

    async def token_seen(server: Server, ssl_context: ssl.SSLContext | None) -> bytes:
        http = await start_http("127.0.0.1", 0, store=None, publish=[], server=server,
                                ssl_context=ssl_context)
        proxy = await RecordingProxy(("127.0.0.1", http.port)).start()
        try:
            scheme = "https" if ssl_context is not None else "http"
            ctx = ssl.create_default_context(cafile=str(pki.ca)) if ssl_context else None

            def get() -> int:
                req = urllib.request.Request(f"{scheme}://127.0.0.1:{proxy.port}/api/server")
                req.add_header("Authorization", f"Bearer {server.sturdyref}")
                with urllib.request.urlopen(req, timeout=TIMEOUT, context=ctx) as r:
                    return r.status

            assert await asyncio.to_thread(get) == 200
        finally:
            await proxy.close()
            await http.close()
        return bytes(proxy.recorded)

    async with tls_server(tmp_path, pki) as server:
        assert server.tls is not None
        seen = await token_seen(server, server.tls.http_context)
        assert len(seen) > 500 and server.sturdyref.sig.hex().encode() not in seen
        assert b'"connections"' not in seen  # nor the answer
    plain = Server(ServerConfig(tcp=["127.0.0.1:0"]), data_dir=tmp_path / "plain")
    await plain.start()
    try:
        seen = await token_seen(plain, None)
        assert plain.sturdyref.sig.hex().encode() in seen and b'"connections"' in seen
    finally:
        await plain.close()


# ---------------------------------------------------------------------------------------
# The warning for a network listener without TLS


@async_test
async def test_warning_once_for_clear_text_on_a_network(tmp_path, pki, caplog):
    with caplog.at_level(logging.WARNING, logger="dataspace.broker.server"):
        server = Server(ServerConfig(tcp=["0.0.0.0:0"], ws=["0.0.0.0:0"],
                                     unix=[str(tmp_path / "s")]), data_dir=tmp_path / "a")
        await server.start()
        await server.close()
    warnings = [r.getMessage() for r in caplog.records if "without TLS" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("listening on 0.0.0.0:0, ws://0.0.0.0:0/ without TLS: "
                                  "capabilities (sturdyrefs")
    assert "--tls-cert" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dataspace.broker.server"):
        for settings in ({"tcp": ["127.0.0.1:0"]},
                         {"tcp": ["0.0.0.0:0"], "tls_cert": str(pki.cert),
                          "tls_key": str(pki.key)}):
            server = Server(ServerConfig(**settings), data_dir=tmp_path / "b")
            await server.start()
            await server.close()
    assert not [r for r in caplog.records if "without TLS" in r.getMessage()]
    http = ServerConfig(http="0.0.0.0:7480").clear_text_warning()
    assert http is not None and "http://0.0.0.0:7480/" in http


# ---------------------------------------------------------------------------------------
# The command line: serve (SIGHUP), client commands, info over HTTPS


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATASPACE_SERVER", "DATASPACE_TLS_CA", "SSL_CERT_FILE")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "dataspace.cli", *args], capture_output=True, text=True,
                          timeout=60, env=_env(**env))


async def _serve(tmp_path: Path, *args: str) -> tuple[asyncio.subprocess.Process, dict[str, str]]:
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "dataspace.cli", "serve", "--data-dir", str(tmp_path / "data"), *args,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    assert proc.stdout is not None and proc.stderr is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), TIMEOUT)).decode()
    assert line.startswith("sturdyref: "), line + (await proc.stderr.read()).decode()
    found = {"sturdyref": line.split(" ", 1)[1].strip()}
    while True:
        s = (await asyncio.wait_for(proc.stderr.readline(), TIMEOUT)).decode()
        assert s, "the server ended"
        if m := re.search(r"listening on (tls://\S+|wss://\S+)", s):
            found[m.group(1).split(":")[0]] = m.group(1)
        if m := re.search(r"HTTP on (\S+)", s):
            found["http"] = m.group(1)
        if "TLS with" in s:
            found["tls_line"] = s
        if "Ctrl-C stops" in s:
            return proc, found


@async_test
async def test_serve_with_tls_and_client_commands(tmp_path, pki):
    cert, key = tmp_path / "live.crt", tmp_path / "live.key"
    c, k = pki.issue("cli one")
    os.replace(c, cert)
    os.replace(k, key)
    proc, found = await _serve(tmp_path, "--tcp", "127.0.0.1:0", "--ws", "127.0.0.1:0",
                               "--http", "127.0.0.1:0", "--tls-cert", str(cert),
                               "--tls-key", str(key))
    try:
        assert f"TLS with {cert} (CN=cli one, issued by O=Dataspace Test CA" in found["tls_line"]
        assert found["http"].startswith("https://127.0.0.1:")
        where, data = found["tls"], str(tmp_path / "data")
        observer = await asyncio.create_subprocess_exec(
            PY, "-m", "dataspace.cli", "observe", "<Note $who $what>", "--server",
            found["wss"], "--tls-ca", str(pki.ca), "--data-dir", data,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env())
        out: list[str] = []
        ready = await connect(where, found["sturdyref"], tls_ca=str(pki.ca))
        try:
            ready.assert_(parse('<Note "test" "ready">'))
            await read_line_matching(observer, r'^\+ <Note "test" "ready">', out)
            r = await asyncio.to_thread(_cli, "send", '<Note "cli" "over tls">', "--server",
                                        where, "--tls-ca", str(pki.ca), "--data-dir", data)
            assert r.returncode == 0, r.stderr
            await read_line_matching(observer, r'^! <Note "cli" "over tls">', out)
        finally:
            await ready.close()
            await kill(observer)
        # The environment instead of options.
        r = await asyncio.to_thread(_cli, "send", "<Ping>", "--data-dir", data,
                                    DATASPACE_SERVER=where, DATASPACE_TLS_CA=str(pki.ca))
        assert r.returncode == 0, r.stderr
        # One line saying what to do, and a non-zero exit.
        r = await asyncio.to_thread(_cli, "send", "<Ping>", "--server", where, "--data-dir", data)
        assert r.returncode == 1
        assert r.stderr.startswith("dataspace send: the server's certificate (CN=cli one")
        assert "not signed by a CA in the system's trust store: pass --tls-ca" in r.stderr
        assert r.stderr.count("\n") == 1
        r = await asyncio.to_thread(_cli, "send", "<Ping>", "--server", where.replace(
            "tls://", ""), "--data-dir", data)
        assert r.returncode == 1 and f"speaks TLS: use {where}" in r.stderr
        # info over HTTPS; plain http:// to it says to use https://.
        r = await asyncio.to_thread(_cli, "info", "--url", found["http"], "--tls-ca",
                                    str(pki.ca), "--data-dir", data)
        assert r.returncode == 0, r.stderr
        assert "connections" in r.stdout
        r = await asyncio.to_thread(_cli, "info", "--url", found["http"].replace(
            "https://", "http://"), "--data-dir", data)
        assert r.returncode == 1
        assert "speaks TLS: use https://" in r.stderr and r.stderr.count("\n") == 1
        r = await asyncio.to_thread(_cli, "info", "--url", found["http"], "--data-dir", data)
        assert r.returncode == 1 and "system's trust store" in r.stderr

        # SIGHUP reloads the certificate.
        c, k = pki.issue("cli two")
        os.replace(c, cert)
        os.replace(k, key)
        assert proc.stderr is not None
        proc.send_signal(signal.SIGHUP)
        line = (await asyncio.wait_for(proc.stderr.readline(), TIMEOUT)).decode()
        assert f"reloaded the TLS certificate {cert} (CN=cli two" in line
        a = parse_address(where)
        assert await served_cn(a.host, a.port, pki.ca) == "cli two"
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), TIMEOUT)


@async_test
async def test_a_failed_tls_reload_is_said_once(tmp_path, pki):
    """Issue 28: a reload that fails (SIGHUP, or the files' change seen at a handshake)
    is one line on the server's standard error, not a log line and a message both."""
    cert, key = tmp_path / "live.crt", tmp_path / "live.key"
    c, k = pki.issue("once one")
    os.replace(c, cert)
    os.replace(k, key)
    proc, found = await _serve(tmp_path, "--tcp", "127.0.0.1:0", "--tls-cert", str(cert),
                               "--tls-key", str(key))
    assert proc.stderr is not None
    a = parse_address(found["tls"])

    async def lines_until(marker: str) -> list[str]:
        out: list[str] = []
        while not out or marker not in out[-1]:
            out.append((await asyncio.wait_for(proc.stderr.readline(), TIMEOUT)).decode())
            assert out[-1], out
        return out

    try:
        # Half a renewal (a certificate without its key), then SIGHUP: one line.
        c2, k2 = pki.issue("once two")
        os.replace(c2, cert)
        proc.send_signal(signal.SIGHUP)
        # ... then the key, and SIGHUP again: the line that ends what the first said.
        said = await lines_until("cannot reload TLS")
        os.replace(k2, key)
        proc.send_signal(signal.SIGHUP)
        said += await lines_until("reloaded the TLS certificate")
        assert sum("does not match" in t for t in said) == 1, said
        assert said[0].startswith("dataspace serve: cannot reload TLS (SIGHUP): ") and \
            said[-1].startswith("dataspace serve: reloaded the TLS certificate"), said
        assert len(said) == 2, said
        # The same without a signal: the files' change is seen at the next handshake.
        c3, _k3 = pki.issue("once three")
        os.replace(c3, cert)
        assert await served_cn(a.host, a.port, pki.ca) == "once two"
        assert await served_cn(a.host, a.port, pki.ca) == "once two"
        proc.send_signal(signal.SIGHUP)  # (still half: says so, and ends the count)
        said = await lines_until("cannot reload TLS (SIGHUP)")
        assert len(said) == 2 and "(its files changed)" in said[0], said
        assert all("does not match" in t for t in said), said
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), TIMEOUT)


def test_serve_refuses_files_it_cannot_use(tmp_path, pki):
    r = _cli("serve", "--tcp", "127.0.0.1:0", "--data-dir", str(tmp_path),
             "--tls-cert", str(pki.cert), "--tls-key", str(pki.client_key))
    assert r.returncode == 1
    assert r.stderr == (f"dataspace serve: the server key {pki.client_key} does not match the "
                        f"server certificate {pki.cert}: give the key the certificate was "
                        "made with\n")
    assert r.stdout == ""  # no sturdyref printed: it never listened


def test_tls_options_in_help(capsys):
    from dataspace.cli import build_parser

    parser = build_parser()
    for cmd in ("serve", "observe", "send", "assert", "info", "top"):
        with pytest.raises(SystemExit):
            parser.parse_args([cmd, "--help"])
        out = capsys.readouterr().out
        assert "--tls-ca" in out, cmd
        if cmd != "serve":
            assert "--tls-insecure-skip-verify" in out and "INSECURE" in out
    args = parser.parse_args(["send", "<x>", "--server", "tls://h:1", "--tls-ca", "ca.crt",
                              "--tls-cert", "c.crt", "--tls-key", "c.key"])
    assert (args.tls_ca, args.tls_cert, args.tls_key) == ("ca.crt", "c.crt", "c.key")


# ---------------------------------------------------------------------------------------
# syndicate-py, unmodified


@async_test
async def test_syndicate_py_connects_over_wss(tmp_path, pki):
    pytest.importorskip("syndicate")
    async with tls_server(tmp_path, pki, ws=["127.0.0.1:0"]) as server:
        ours = await connect(address(server, "tls"), server.sturdyref, tls_ca=str(pki.ca))
        seen = Changes()
        ours.observe("<Says $who $what>", **seen.kw())
        await ours.sync()
        # syndicate-py's WebSocket transport opens wss:// URLs with the default SSL
        # context, which trusts SSL_CERT_FILE: our test CA.
        proc = await asyncio.create_subprocess_exec(
            PY, SCRIPT, f'<ws "{address(server, "wss")}">', str(server.sturdyref), "carol",
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=_env(SSL_CERT_FILE=str(pki.ca)))
        out: list[str] = []
        try:
            await read_line_matching(proc, r"^connected$", out)
            await seen.until(lambda s: ("carol", "hello") in s.messages())
            ours.assert_(parse('<Present "ours">'))
            await read_line_matching(proc, r"^\+ ours$", out)
        finally:
            await kill(proc)
        await ours.close()


# ---------------------------------------------------------------------------------------
# docs/security.md: its openssl commands run, and make certificates that work


def test_security_md_openssl_commands_make_working_certificates(tmp_path, monkeypatch):
    from test_docs_examples import Reader, blocks

    r = Reader(tmp_path, monkeypatch)
    r.run(blocks("docs/security.md"))
    assert r.ran >= 1
    work = r.work
    for name in ("ca.crt", "server.crt", "server.key", "alice.crt", "alice.key"):
        assert (work / name).is_file(), name
    info = read_certificate(work / "server.crt")
    assert info is not None and info.subject == "CN=localhost"
    assert info.names == ("DNS:localhost", "IP:127.0.0.1")

    async def main() -> None:
        server = Server(ServerConfig(tcp=["127.0.0.1:0"], tls_cert=str(work / "server.crt"),
                                     tls_key=str(work / "server.key"),
                                     tls_client_ca=str(work / "ca.crt")),
                        data_dir=tmp_path / "data")
        await server.start()
        try:
            port = server.addresses[0].port
            for host in ("localhost", "127.0.0.1"):
                ds = await connect(f"tls://{host}:{port}", server.sturdyref,
                                   tls_ca=str(work / "ca.crt"), tls_cert=str(work / "alice.crt"),
                                   tls_key=str(work / "alice.key"))
                await ds.sync()
                await ds.close()
        finally:
            await server.close()

    asyncio.run(asyncio.wait_for(main(), 60))
