"""Checkpoints in object storage, against a real S3-compatible server (moto's) started on
127.0.0.1 with its credential checks on: every format read from and written to ``s3://``
URLs byte-identical to the same conversion between local paths; ``inspect``, ``plan``,
``verify``, ``diff``, :func:`reshard.open` and the torch loader on URLs; a rank's load
fetching only its bytes; wrong credentials, a missing object, a server that stops during an
upload and a killed upload each ending in a clear error and no visible checkpoint, and the
killed run's incomplete multipart upload aborted by the next run."""

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import reshard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import _quiet, same  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures"
BIN = Path(sys.executable).parent / "reshard"
MOTO = Path(sys.executable).parent / "moto_server"

boto3 = pytest.importorskip("boto3") if not os.environ.get("CI") else __import__("boto3")
if not MOTO.exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"{MOTO} is missing: scripts/setup_venv.sh --s3 installs it")
    pytest.skip("moto_server is not installed (scripts/setup_venv.sh --s3)", allow_module_level=True)

BUCKET = "ckpts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """moto's S3 server on 127.0.0.1, with an IAM user whose keys it checks."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "moto.log"
        env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="4")
        self.proc = subprocess.Popen(
            [str(MOTO), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=self.log.open("w"), env=env,
        )
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"moto_server did not start: {self.log.read_text()[-2000:]}")
                time.sleep(0.1)
        anon = dict(endpoint_url=self.url, region_name="us-east-1",
                    aws_access_key_id="setup", aws_secret_access_key="setup")
        iam = boto3.client("iam", **anon)
        iam.create_user(UserName="trainer")
        iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        self.key, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        self.s3 = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                               aws_access_key_id=self.key, aws_secret_access_key=self.secret)
        self.s3.create_bucket(Bucket=BUCKET)

    def env(self, endpoint: str = "") -> dict:
        return {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret,
                "AWS_ENDPOINT_URL": endpoint or self.url, "AWS_REGION": "us-east-1"}

    def put_tree(self, local: Path, prefix: str) -> str:
        """Upload a file or folder; its URL."""
        if local.is_file():
            self.s3.upload_file(str(local), BUCKET, prefix)
        else:
            for f in sorted(local.rglob("*")):
                if f.is_file():
                    self.s3.upload_file(str(f), BUCKET, f"{prefix}/{f.relative_to(local)}")
        return f"s3://{BUCKET}/{prefix}"

    def objects(self, prefix: str) -> dict:
        """Every object under ``prefix`` (the object itself when it is one) with its bytes,
        keyed like :func:`files` keys a local output."""
        out = {}
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        for page in pages:
            for o in page.get("Contents", []):
                k = o["Key"]
                if k == prefix:
                    rel = ""
                elif k.startswith(prefix + "/"):
                    rel = k[len(prefix) + 1:]
                else:
                    continue
                out[rel] = self.s3.get_object(Bucket=BUCKET, Key=k)["Body"].read()
        return out

    def uploads(self) -> list:
        return [u["Key"] for u in self.s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("moto"))
    yield s
    s.stop()


@pytest.fixture
def s3env(server, tmp_path, monkeypatch):
    """The server's credentials and endpoint in this process's environment (and so in the
    commands it runs), a journal and scratch folder of the test's own."""
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RESHARD_UPLOAD_JOURNAL", str(tmp_path / "journal"))
    monkeypatch.setenv("RESHARD_SCRATCH", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    return server


def files(p: Path) -> dict:
    """Every file of an output (a file or a folder) with its bytes."""
    if p.is_file():
        return {"": p.read_bytes()}
    return {str(f.relative_to(p)): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


def cli(*args, env=None, check=True, timeout=300):
    r = subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True,
                       env=None if env is None else dict(os.environ, **env), timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"reshard {' '.join(map(str, args))}: exit {r.returncode}: {r.stderr}")
    return r


# Sources of every format reshard reads (committed fixtures, or made from one).
SOURCES = {
    "dcp": "fsdp2_w4_f32/checkpoint",
    "lightning": "fabric_fsdp1_w4_f32/checkpoint",
    "torch21-shardedtensor": "torch21_shardedtensor_w3/checkpoint",
    "hf-storage": "hf_storage_w4_f32/checkpoint",
    "deepspeed": "deepspeed/zero3_dp2_f32_g1/checkpoint",
    "megatron": "megatron/mcore016_tp2_dp2/checkpoint",
    "torchtitan": "torchtitan/fsdp2_w2_f32/checkpoint",
    "pt": "pt/training/model.pt",
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A single .safetensors file and an hf folder, made by reshard from the DCP fixture."""
    d = tmp_path_factory.mktemp("made")
    src = FIX / SOURCES["dcp"]
    reshard.convert(src, d / "model.safetensors", world_size=1, per_rank_state="drop")
    reshard.convert(src, d / "hf", world_size=1, format="hf", per_rank_state="drop",
                    max_shard_size=20_000)
    return {"safetensors": d / "model.safetensors", "hf": d / "hf"}


@pytest.mark.parametrize("name", list(SOURCES) + ["safetensors", "hf"])
def test_every_format_read_from_s3_equals_the_local_conversion(s3env, made, name, tmp_path):
    local = made[name] if name in made else FIX / SOURCES[name]
    url = s3env.put_tree(local, f"in/{name}" + (local.suffix if local.is_file() else ""))
    for world, fmt in [(1, "safetensors"), (3, "dcp")]:
        want = tmp_path / f"want-{world}"
        got = tmp_path / f"got-{world}"
        reshard.convert(local, want, world_size=world, format=fmt, per_rank_state="drop")
        reshard.convert(url, got, world_size=world, format=fmt, per_rank_state="drop")
        assert files(got) == files(want), f"{name} -> {fmt}@{world}"
        assert files(want), "the local conversion wrote nothing"


OUTPUTS = [
    ("safetensors", 1, "out.safetensors"),
    ("pt", 1, "out.pt"),
    ("hf", 1, "hf"),
    ("hf-storage", 2, "hfs"),
    ("dcp", 3, "dcp"),
    ("megatron", 2, "megatron"),
]


@pytest.mark.parametrize("fmt,world,name", OUTPUTS)
def test_every_format_written_to_s3_equals_the_local_conversion(s3env, fmt, world, name, tmp_path):
    src = FIX / SOURCES["dcp"]
    want = tmp_path / name
    reshard.convert(src, want, world_size=world, format=fmt, per_rank_state="drop")
    prefix = f"out/{fmt}/{name}"
    reshard.convert(src, f"s3://{BUCKET}/{prefix}", world_size=world, format=fmt,
                    per_rank_state="drop")
    assert s3env.objects(prefix) == files(want)
    # ... and read back from the store, N->M again, byte-exact.
    back, back_want = tmp_path / "back", tmp_path / "back-want"
    reshard.convert(f"s3://{BUCKET}/{prefix}", back, world_size=2, format="dcp")
    reshard.convert(want, back_want, world_size=2, format="dcp")
    assert files(back) == files(back_want)
    assert reshard.verify(f"s3://{BUCKET}/{prefix}")["ok"]


def test_deepspeed_in_and_out_of_s3(s3env, tmp_path):
    src = FIX / SOURCES["deepspeed"]
    url = s3env.put_tree(src, "in/ds-roundtrip")
    want = tmp_path / "want"
    reshard.convert(src, want, world_size=3, format="deepspeed")
    reshard.convert(url, f"s3://{BUCKET}/out/ds3", world_size=3, format="deepspeed")
    assert s3env.objects("out/ds3") == files(want)


def test_s3_to_s3_with_the_command(s3env, tmp_path):
    src = FIX / SOURCES["dcp"]
    url = s3env.put_tree(src, "in/cli-dcp")
    r = cli("convert", url, f"s3://{BUCKET}/out/cli-2", "--to", "2", "--per-rank-state", "drop")
    assert f"wrote s3://{BUCKET}/out/cli-2:" in r.stdout
    want = tmp_path / "want"
    cli("convert", src, want, "--to", "2", "--per-rank-state", "drop")
    assert s3env.objects("out/cli-2") == files(want)
    # An existing destination is refused without --force, replaced with it.
    r = cli("convert", url, f"s3://{BUCKET}/out/cli-2", "--to", "3", "--per-rank-state", "drop",
            check=False)
    assert r.returncode == 2 and "exists" in r.stderr and "--force" in r.stderr
    cli("convert", url, f"s3://{BUCKET}/out/cli-2", "--to", "3", "--per-rank-state", "drop",
        "--force")
    want3 = tmp_path / "want3"
    cli("convert", src, want3, "--to", "3", "--per-rank-state", "drop")
    assert s3env.objects("out/cli-2") == files(want3)


def test_inspect_plan_verify_diff_accept_urls(s3env, tmp_path):
    src = FIX / SOURCES["dcp"]
    url = s3env.put_tree(src, "in/cmds")
    assert cli("inspect", url).stdout == cli("inspect", src).stdout.replace(str(src), url)
    plan_url = json.loads(cli("plan", url, "--to", "3", "--per-rank-state", "drop", "--json").stdout)
    plan_local = json.loads(cli("plan", src, "--to", "3", "--per-rank-state", "drop", "--json").stdout)
    assert plan_url["plan"] == plan_local["plan"] and plan_url["plan"]["ops"]
    assert plan_url["target"] == plan_local["target"]
    assert plan_url["source"]["files"] == [f"{url}/__{r}_0.distcp" for r in range(4)]
    assert "all match" in cli("verify", url).stdout
    assert cli("diff", url, src).returncode == 0
    other = s3env.put_tree(FIX / "fsdp2_w2_f32" / "checkpoint", "in/cmds-other")
    assert cli("diff", url, other, check=False).returncode == 1


def test_open_and_torch_load_from_s3(s3env, tmp_path):
    src = FIX / SOURCES["dcp"]
    url = s3env.put_tree(src, "in/open")
    with reshard.open(src) as a, reshard.open(url) as b:
        assert b.path == url and a.keys() == b.keys()
        names = [t.name for t in a.tensors()]
        assert names and names == [t.name for t in b.tensors()]
        for k in names:
            assert same(a.get_tensor(k), b.get_tensor(k)), k
        assert a.values() == b.values()
    sd = {k: torch.zeros_like(v) for k, v in _local_tensors(src).items()}
    import reshard.torch as rt
    rt.load(sd, url, strict=False)
    for k, v in _local_tensors(src).items():
        assert same(sd[k], v), k
    # torch's own loader through reshard's StorageReader, from the URL.
    from reshard._reader import StorageReader
    assert StorageReader.validate_checkpoint_id(url)
    sd2 = {k: torch.zeros_like(v) for k, v in _local_tensors(src).items()}
    dcp.load(sd2, storage_reader=StorageReader(url), no_dist=True)
    for k, v in _local_tensors(src).items():
        assert same(sd2[k], v), k
    # the StorageMeta saved in the .metadata, read from the URL
    with open(src / ".metadata", "rb") as f:
        want = pickle.load(f).storage_meta
    sm = StorageReader(url).read_metadata().storage_meta
    assert want is not None and (sm.checkpoint_id, sm.save_id) == (want.checkpoint_id, want.save_id)


def _local_tensors(src: Path) -> dict:
    with reshard.open(src) as ck:
        return {t.name: ck.get_tensor(t.name) for t in ck.tensors() if t.name.startswith("model.")}


def test_a_ranks_load_fetches_only_its_bytes(s3env, tmp_path):
    """Rank r of M reads its Shard(0) rows of every tensor of a checkpoint saved at 4 ranks:
    the bytes fetched (index included) stay within 5% of the bytes it needs."""
    g = torch.Generator().manual_seed(3)
    sd = {f"layers.{i}.w": torch.randn(512 + 17 * i, 1024, generator=g) for i in range(6)}
    sd["emb"] = torch.randn(3001, 256, generator=g).to(torch.bfloat16)
    ck = tmp_path / "ck"
    _save_at(sd, ck, world=4)
    url = s3env.put_tree(ck, "in/rank-load")
    for world, rank in [(3, 1), (8, 5), (1, 0)]:
        before = reshard.fetch_stats()
        with reshard.open(url) as c:
            shards = c.local_shards(rank, world)
        after = reshard.fetch_stats()
        needed = sum(s.tensor.numel() * s.tensor.element_size() for s in shards)
        fetched = after["bytes"] - before["bytes"]
        requests = after["requests"] - before["requests"]
        for s in shards:
            rows = slice(s.offsets[0], s.offsets[0] + s.tensor.shape[0])
            assert same(s.tensor, sd[s.name][rows]), s.name
        print(f"rank {rank} of {world}: needed {needed} B, fetched {fetched} B "
              f"({fetched / needed:.4f}x) in {requests} requests")
        assert needed <= fetched <= 1.05 * needed, (world, rank, needed, fetched)


def _save_at(sd: dict, path: Path, world: int) -> None:
    """``sd`` saved by DCP as ``world`` ranks would, each with its Shard(0) chunk (made by
    reshard's own Shard(0) conversion of a one-rank save, then checked by torch)."""
    one = path.parent / (path.name + "-1")
    dcp.save(sd, checkpoint_id=str(one), no_dist=True)
    reshard.convert(one, path, world_size=world, format="dcp")
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(back, checkpoint_id=str(path), no_dist=True)
    assert all(same(back[k], v) for k, v in sd.items())


def test_wrong_credentials_fail_fast_with_a_clear_error(server, tmp_path):
    env = dict(server.env(), AWS_SECRET_ACCESS_KEY="not-the-secret")
    url = server.put_tree(FIX / SOURCES["pt"], "in/creds.pt")
    lines_before = len(server.log.read_text().splitlines())
    t = time.time()
    r = cli("inspect", url, env=env, check=False)
    elapsed = time.time() - t
    assert r.returncode == 2
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"reshard: error: {url}: access denied (check the credentials"), err
    assert "SignatureDoesNotMatch" in err, err
    new = server.log.read_text().splitlines()[lines_before:]
    refused = [line for line in new if '" 403 ' in line]
    assert 1 <= len(refused) <= 2, new  # no retries of a refused credential
    assert elapsed < 10
    # Writing with a key the server does not know: refused before any conversion is done.
    env = dict(server.env(), AWS_ACCESS_KEY_ID="AKIANOTAKEY")
    r = cli("convert", FIX / SOURCES["pt"], f"s3://{BUCKET}/out/creds.safetensors", "--to", "1",
            env=env, check=False)
    assert r.returncode == 2 and "InvalidAccessKeyId" in r.stderr and "access denied" in r.stderr
    assert server.objects("out/creds.safetensors") == {}


def test_a_missing_object_is_named(s3env, tmp_path):
    url = f"s3://{BUCKET}/nothing/here"
    r = cli("inspect", url, check=False)
    assert r.returncode == 2 and r.stderr.strip() == f"reshard: error: {url}: not found"
    with pytest.raises(reshard.ReshardError, match=f"^{url}: not found$"):
        reshard.open(url)
    r = cli("inspect", "s3://no-such-bucket/x", check=False)
    assert r.returncode == 2 and "NoSuchBucket" in r.stderr
    # A checkpoint whose data object went missing after its index was written.
    src = FIX / SOURCES["dcp"]
    s3env.put_tree(src, "in/holed")
    s3env.s3.delete_object(Bucket=BUCKET, Key="in/holed/__2_0.distcp")
    r = cli("convert", f"s3://{BUCKET}/in/holed", tmp_path / "o", "--to", "1", check=False)
    assert r.returncode == 2 and f"s3://{BUCKET}/in/holed" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


class Proxy:
    """A TCP relay to the server that, once ``limit`` bytes went to the server, stops: it
    closes every connection and listens no more (a server that went away mid-upload)."""

    def __init__(self, port: int, limit: int) -> None:
        self.limit, self.sent, self.stopped = limit, 0, threading.Event()
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.url = f"http://127.0.0.1:{self.lsock.getsockname()[1]}"
        self.port, self.socks, self.lock = port, [], threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self.port))
            with self.lock:
                self.socks += [c, u]
            threading.Thread(target=self._pump, args=(c, u, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, False), daemon=True).start()

    def _pump(self, a, b, upstream: bool) -> None:
        try:
            while True:
                data = a.recv(1 << 16)
                if not data:
                    break
                if upstream:
                    with self.lock:
                        self.sent += len(data)
                        over = self.sent > self.limit
                    if over:
                        self.stop()
                        return
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self.stopped.set()
        with self.lock:
            socks = list(self.socks)
        for s in [self.lsock, *socks]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A DCP checkpoint of ~48 MB at 2 ranks: its outputs at 1 rank are one file of three
    upload chunks, at 2 ranks two data files of two and the index."""
    d = tmp_path_factory.mktemp("big")
    g = torch.Generator().manual_seed(11)
    sd = {f"w{i}": torch.randn(1500, 2000, generator=g) for i in range(4)}
    _save_at(sd, d / "ck", world=2)
    return d / "ck"


SMALL_CHUNKS = {"RESHARD_UPLOAD_CHUNK": str(5 << 20), "RESHARD_UPLOAD_BATCH": str(10 << 20)}


@pytest.mark.parametrize("small", [False, True], ids=["default-chunks", "5MiB-chunks"])
@pytest.mark.parametrize("name,world", [("big.pt", 1), ("big.safetensors", 1), ("dcp", 2)])
def test_large_outputs_are_streamed_byte_exact(s3env, big, name, world, small, tmp_path):
    """Outputs of several upload chunks, sent while the next batch is written (with 5 MiB
    chunks and 10 MiB batches: many of both): a .pt's zip CRCs and DCP's per-item zip records
    (written once their bytes are) land right."""
    want = tmp_path / name
    cli("convert", big, want, "--to", world)
    prefix = f"out/streamed/{small}/{name}"
    cli("convert", big, f"s3://{BUCKET}/{prefix}", "--to", world, env=SMALL_CHUNKS if small else None)
    got = s3env.objects(prefix)
    assert got == files(want)
    assert max(len(b) for b in got.values()) > (16 << 20)
    assert not s3env.uploads()


def test_a_conversion_from_s3_fetches_each_byte_once(s3env, big, tmp_path):
    """The copy and the source check beside it read the same bytes: fetched once."""
    url = s3env.put_tree(big, "in/once")
    size = sum(f.stat().st_size for f in big.iterdir())
    before = reshard.fetch_stats()
    reshard.convert(url, tmp_path / "out", world_size=3, verify=True)
    fetched = reshard.fetch_stats()["bytes"] - before["bytes"]
    assert size * 0.95 <= fetched <= size * 1.01, (fetched, size)


def test_force_onto_a_checkpoint_never_leaves_a_loadable_mix(s3env, big, tmp_path):
    """--force removes the old checkpoint's objects (its loadable ones first) before the new
    upload: a failed replacement leaves nothing loadable, not old index over new data."""
    dst = f"s3://{BUCKET}/out/replaced"
    cli("convert", big, dst, "--to", "2")
    assert ".metadata" in s3env.objects("out/replaced")
    other = tmp_path / "other"
    g = torch.Generator().manual_seed(12)
    _save_at({f"w{i}": torch.randn(1500, 2000, generator=g) for i in range(4)}, other, world=2)
    proxy = Proxy(s3env.port, limit=30 << 20)
    r = cli("convert", other, dst, "--to", "2", "--force", env={"AWS_ENDPOINT_URL": proxy.url},
            check=False)
    assert proxy.stopped.is_set() and r.returncode == 2 and "upload failed" in r.stderr
    assert "replaced were removed before the upload" in r.stderr, r.stderr
    assert ".metadata" not in s3env.objects("out/replaced")
    assert cli("inspect", dst, check=False).returncode == 2


def test_folder_markers_odd_names_and_companions_beside_the_folder(s3env, tmp_path):
    """Objects a bucket also holds: empty "folder" markers (consoles and sync tools make
    them), keys with characters URLs escape, and a config.json beside DeepSpeed's tag folders
    (an hf output carries it) — opened as the same folder on disk would be."""
    src = FIX / SOURCES["deepspeed"]
    local = tmp_path / "ds"
    shutil.copytree(src, local)
    (local / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    (local / "notes [1] #~%.txt").write_text("kept beside the checkpoint")
    url = s3env.put_tree(local, "in/odd")
    s3env.s3.put_object(Bucket=BUCKET, Key="in/odd/", Body=b"")
    s3env.s3.put_object(Bucket=BUCKET, Key="in/odd/global_step2/", Body=b"")
    want, got = tmp_path / "want", tmp_path / "got"
    reshard.convert(local, want, world_size=1, format="hf")
    reshard.convert(url, got, world_size=1, format="hf")
    assert files(got) == files(want) and "config.json" in files(want)


def test_a_server_stopped_mid_upload_leaves_no_checkpoint(s3env, big, tmp_path):
    proxy = Proxy(s3env.port, limit=30 << 20)
    env = {"AWS_ENDPOINT_URL": proxy.url}
    dst = f"s3://{BUCKET}/out/stopped"
    t = time.time()
    r = cli("convert", big, dst, "--to", "2", env=env, check=False)
    assert proxy.stopped.is_set()
    assert r.returncode == 2, r.stdout
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "upload failed" in err and dst in err, err
    assert time.time() - t < 120
    # The index that makes it loadable was never written; what the server holds under the
    # prefix is not a checkpoint.
    assert ".metadata" not in s3env.objects("out/stopped")
    r = cli("inspect", dst, check=False)
    assert r.returncode == 2
    # The same command against the server proper completes it, byte-exact, and aborts the
    # multipart upload the failed run could not.
    r = cli("convert", big, dst, "--to", "2", "--force")
    want = tmp_path / "want"
    cli("convert", big, want, "--to", "2")
    assert s3env.objects("out/stopped") == files(want)
    assert "out/stopped/__0_0.distcp" not in s3env.uploads()
    assert not any(u.startswith("out/stopped") for u in s3env.uploads())


def test_a_killed_upload_is_invisible_and_the_next_run_aborts_its_leftovers(s3env, big, tmp_path):
    dst = f"s3://{BUCKET}/out/killed.safetensors"
    journal = Path(os.environ["RESHARD_UPLOAD_JOURNAL"])
    p = subprocess.Popen([str(BIN), "convert", str(big), dst, "--to", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=dict(os.environ, **SMALL_CHUNKS))
    deadline = time.time() + 120
    while not (journal.is_dir() and any(journal.glob("*.json"))):
        assert p.poll() is None, p.stderr.read()
        assert time.time() < deadline
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert s3env.objects("out/killed.safetensors") == {}  # nothing visible
    assert "out/killed.safetensors" in s3env.uploads()  # its multipart upload, listed
    scratch = Path(os.environ["RESHARD_SCRATCH"])
    assert any(scratch.iterdir())  # the killed run's staging folder
    r = cli("convert", big, dst, "--to", "1")
    assert "aborted the incomplete multipart upload(s) an earlier, killed run left" in r.stdout
    assert "out/killed.safetensors" not in s3env.uploads()
    assert not list(journal.glob("*.json"))
    assert not any(scratch.iterdir())  # its staging folder removed too
    want = tmp_path / "want.safetensors"
    cli("convert", big, want, "--to", "1")
    assert s3env.objects("out/killed.safetensors") == files(want)


def test_parts_read_from_s3(s3env, tmp_path):
    """Workers of a split conversion may read their source from object storage."""
    src = FIX / SOURCES["dcp"]
    url = s3env.put_tree(src, "in/parts")
    out = tmp_path / "parts"
    for k in range(3):
        cli("convert", url, out, "--to", "2", "--per-rank-state", "drop", "--part", f"{k}/3")
    want = tmp_path / "want"
    cli("convert", src, want, "--to", "2", "--per-rank-state", "drop")
    assert files(out) == files(want)


def test_parts_write_to_s3_through_a_staging_folder(s3env, big, tmp_path):
    """Parts of a conversion to a URL meet in a staging folder; the worker that commits
    uploads the output, byte-identical to the one-process conversion, and the folder is left
    empty. Without a staging folder the command says what it needs."""
    staging = tmp_path / "staging"
    staging.mkdir()
    dst = f"s3://{BUCKET}/out/parts-dcp"
    r = cli("convert", big, dst, "--to", "3", "--part", "0/2", check=False)
    assert r.returncode == 2 and "--staging DIR" in r.stderr, r.stderr
    r1 = cli("convert", big, dst, "--to", "3", "--part", "1/2", "--staging", staging)
    assert "waiting for part(s) 0" in r1.stdout and s3env.objects("out/parts-dcp") == {}
    r0 = cli("convert", big, dst, "--to", "3", "--part", "0/2", "--staging", staging)
    assert f"committed {dst}" in r0.stdout, r0.stdout
    want = tmp_path / "want"
    cli("convert", big, want, "--to", "3")
    assert s3env.objects("out/parts-dcp") == files(want)
    assert list(staging.iterdir()) == []
    # From Python, into one file, with the staging folder from the environment.
    os.environ["RESHARD_STAGING"] = str(staging)
    try:
        dst1 = f"s3://{BUCKET}/out/parts-one.safetensors"
        for k in (2, 0, 1):
            res = reshard.convert(big, dst1, world_size=1, part=(k, 3))
        assert res["parts"]["committed"] == "published"
    finally:
        del os.environ["RESHARD_STAGING"]
    want1 = tmp_path / "want1.safetensors"
    reshard.convert(big, want1, world_size=1)
    assert s3env.objects("out/parts-one.safetensors") == files(want1)


def test_a_failed_upload_of_parts_is_finished_by_commit(s3env, big, tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    dst = f"s3://{BUCKET}/out/parts-retry"
    cli("convert", big, dst, "--to", "2", "--part", "0/2", "--staging", staging)
    proxy = Proxy(s3env.port, limit=30 << 20)
    r = cli("convert", big, dst, "--to", "2", "--part", "1/2", "--staging", staging,
            env={"AWS_ENDPOINT_URL": proxy.url}, check=False)
    assert proxy.stopped.is_set() and r.returncode == 2 and "upload failed" in r.stderr, r.stderr
    assert ".metadata" not in s3env.objects("out/parts-retry")
    r = cli("commit", dst, "--staging", staging, "--force")
    want = tmp_path / "want"
    cli("convert", big, want, "--to", "2")
    assert s3env.objects("out/parts-retry") == files(want)
    assert list(staging.iterdir()) == []
    assert not any(u.startswith("out/parts-retry") for u in s3env.uploads())
