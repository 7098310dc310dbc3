"""A model's tokenizer files, carried over NATS to the hosts that do not hold the model.

The gateway tokenizes every request with the tokenizer its model's workers use, found by
the directory a worker registers (``WorkerInfo.model_dir``). On one host, or where a
volume is shared, that directory is there; in a cluster the weights live on GPU hosts
only (a vLLM worker's hub download, a Nomad host volume), so a worker also puts its
tokenizer files in the ``<root>_tokenizers`` object store, named by the SHA-256 of
their bundle (``WorkerInfo.tokenizer_digest``), and a gateway, a router or ``meshserve
tokenizer export`` that cannot read ``model_dir`` fetches that bundle into a local cache
(``MESHSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/meshserve``, else ``~/.cache/meshserve``).
The name is the content: the same tokenizer on many workers is stored once, and a
bundle taken from the cache is the one the worker announced.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from nats.js import JetStreamContext, api
from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from proto.subjects import Subjects
from proto.workers import WorkerInfo

from .registry import WorkerRegistry
from .tasks import cancel_and_wait

log = logging.getLogger(__name__)

# What a tokenizer is made of (as ``services.common.tokenizer.HFTokenizer`` and
# ``transformers.AutoTokenizer`` read it); weights and model config stay on the GPU host.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# Bounds the bucket: tokenizers are 1-35 MB; a full bucket refuses a new one (the worker
# logs it and serves on; only hosts without its directory miss it) rather than dropping
# one that gateways still fetch.
BUCKET_MAX_BYTES = 2 << 30
# A digest names a cache directory: only 64 hex digits may (a registry entry is input).
DIGEST = re.compile(r"[0-9a-f]{64}")


def bundle(directory: str | Path) -> tuple[str, bytes] | None:
    """The tokenizer files of ``directory`` as one tar and its SHA-256 (hex), or None
    when it holds no ``tokenizer.json``. Deterministic: the same files, the same digest."""
    path = Path(directory)
    if not (path / "tokenizer.json").is_file():
        return None
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in TOKENIZER_FILES:
            file = path / name
            if not file.is_file():
                continue
            data = file.read_bytes()
            entry = tarfile.TarInfo(name)
            entry.size, entry.mode, entry.mtime = len(data), 0o644, 0
            tar.addfile(entry, io.BytesIO(data))
    data = out.getvalue()
    return hashlib.sha256(data).hexdigest(), data


def unpack(digest: str, data: bytes, into: Path) -> Path:
    """Check ``data`` against ``digest`` and extract its files to ``into/digest`` (atomic:
    a directory appears whole or not at all)."""
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"tokenizer bundle {digest[:12]} does not match its digest")
    target = into / digest
    if (target / "tokenizer.json").is_file():
        return target
    into.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}-", dir=into))
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            for member in tar.getmembers():
                if not member.isfile() or member.name not in TOKENIZER_FILES:
                    raise ValueError(f"tokenizer bundle {digest[:12]} holds an unexpected entry {member.name!r}")
                source = tar.extractfile(member)
                assert source is not None
                (staging / member.name).write_bytes(source.read())
        try:
            staging.rename(target)
        except OSError:  # another process unpacked it first
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def cache_root() -> Path:
    explicit = os.environ.get("MESHSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit) / "tokenizers"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshserve" / "tokenizers"


def object_store_config(subjects: Subjects, replicas: int) -> api.ObjectStoreConfig:
    return api.ObjectStoreConfig(
        bucket=subjects.tokenizers_bucket,
        description="meshserve tokenizer files by SHA-256, for hosts without the model's directory",
        storage=api.StorageType.FILE,
        max_bytes=BUCKET_MAX_BYTES,
        replicas=replicas,
    )


async def tokenizer_store(js: JetStreamContext, subjects: Subjects, *, replicas: int = 1) -> ObjectStore:
    try:
        return await js.object_store(subjects.tokenizers_bucket)
    except (BucketNotFoundError, NotFoundError):
        log.info("creating object store %s", subjects.tokenizers_bucket)
        # nats-py sets config.bucket from its own argument: both, or it is None.
        return await js.create_object_store(subjects.tokenizers_bucket, config=object_store_config(subjects, replicas))


async def publish(js: JetStreamContext, subjects: Subjects, directory: str, *, replicas: int = 1) -> str:
    """Put ``directory``'s tokenizer in the object store unless it is there; its digest
    ("" when the directory holds no tokenizer, or the store refused it: hosts that
    cannot read the directory then cannot serve the model, which the log says)."""
    packed = await asyncio.to_thread(bundle, directory)
    if packed is None:
        return ""
    digest, data = packed
    try:
        store = await tokenizer_store(js, subjects, replicas=replicas)
        try:
            await store.get_info(digest)
        except ObjectNotFoundError:
            try:
                await store.put(digest, data)
            except Exception:
                # A worker beside it stored the same bundle first: nats-py then purges the
                # replaced copy's chunks, which workers may not (PERMISSIONS.md). The
                # object is whole all the same (its meta names this put's chunks).
                await store.get_info(digest)
            log.info("tokenizer of %s stored as %s (%d bytes)", directory, digest[:12], len(data))
    except Exception as exc:
        log.error("cannot store the tokenizer of %s in %s: %r; hosts without that directory cannot "
                  "tokenize for this model", directory, subjects.tokenizers_bucket, exc)
        return ""
    return digest


async def fetch(js: JetStreamContext, subjects: Subjects, digest: str, into: Path | None = None) -> Path:
    """The local directory of tokenizer ``digest``, fetched from the object store unless
    the cache holds it."""
    if not DIGEST.fullmatch(digest):
        raise ValueError(f"not a tokenizer digest: {digest[:80]!r}")
    into = into or cache_root()
    target = into / digest
    if (target / "tokenizer.json").is_file():
        return target
    data = await read_object(js, subjects.tokenizers_bucket, digest)
    return await asyncio.to_thread(unpack, digest, data, into)


async def read_object(js: JetStreamContext, bucket: str, name: str, timeout_s: float = 30.0) -> bytes:
    """An object's bytes. nats-py's ``ObjectStore.get`` looks its stream up by subject
    (``$JS.API.STREAM.NAMES``, which no service may call); this names it."""
    store = await js.object_store(bucket)
    info = await store.get_info(name)
    if not info.size:
        return b""
    sub = await js.subscribe(f"$O.{bucket}.C.{info.nuid}", stream=f"OBJ_{bucket}", ordered_consumer=True)
    parts: list[bytes] = []
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                msg = await sub.next_msg(timeout=None)
                parts.append(msg.data)
                if msg.metadata.num_pending == 0:
                    break
    finally:
        await sub.unsubscribe()
    return b"".join(parts)


def directory_of(model_dir: str, tokenizer: str) -> str:
    """The directory a worker's tokenizer is read from ("" for the sim's byte tokenizer):
    its model's, else the one its engine was given (``--engine echo --tokenizer DIR``)."""
    return model_dir or ("" if tokenizer in ("", "byte") else tokenizer)


def readable_dir(directory: str) -> bool:
    return bool(directory) and (Path(directory) / "tokenizer.json").is_file()


class TokenizerFiles:
    """A service's view of where each worker's tokenizer is on this host.

    ``source(info)`` is what to load (``load_tokenizer``'s spec): the worker's own
    directory where this host can read it, else the fetched copy of its bundle; None while
    that copy is on its way (``want`` fetches it in the background, once per digest).
    """

    def __init__(self, js: JetStreamContext, subjects: Subjects, *, into: Path | None = None,
                 on_fetched: Callable[[str], None] | None = None) -> None:
        self.js = js
        self.subjects = subjects
        self.into = into or cache_root()
        self.on_fetched = on_fetched
        self._local: dict[str, bool] = {}  # model_dir → readable here (checked once)
        self._fetched: dict[str, str] = {}  # digest → local directory
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.failures = 0

    def source(self, info: WorkerInfo) -> str | None:
        directory = directory_of(info.model_dir, info.tokenizer)
        if not directory or not DIGEST.fullmatch(info.tokenizer_digest):
            return directory or "byte"
        local = self._local.get(directory)
        if local is None:
            local = self._local[directory] = readable_dir(directory)
        if local:
            return directory
        return self._fetched.get(info.tokenizer_digest)

    def want(self, info: WorkerInfo) -> None:
        """Start fetching ``info``'s tokenizer if this host needs it and has not got it."""
        digest = info.tokenizer_digest
        if not digest or digest in self._fetched or digest in self._tasks or self.source(info) is not None:
            return
        self._tasks[digest] = asyncio.get_running_loop().create_task(self._fetch(digest, info.model), name="tokenizer-fetch")

    async def _fetch(self, digest: str, model: str) -> None:
        # One try: a failure is tried again at the worker's next heartbeat (every few s).
        try:
            path = await fetch(self.js, self.subjects, digest, self.into)
        except Exception as exc:
            self.failures += 1
            log.log(logging.ERROR if self.failures == 1 else logging.DEBUG,
                    "cannot fetch the tokenizer of %s (%s) from %s: %r; its requests are refused until it "
                    "arrives (tried again at each heartbeat)", model, digest[:12], self.subjects.tokenizers_bucket, exc)
            return
        finally:
            self._tasks.pop(digest, None)
        self._fetched[digest] = str(path)
        log.info("tokenizer of %s (%s) fetched to %s", model, digest[:12], path)
        if self.on_fetched is not None:
            self.on_fetched(digest)

    def watch(self, registry: WorkerRegistry) -> None:
        """Fetch what ``registry``'s workers announce, those listed now and those to come."""
        registry.on_change(lambda _worker_id, info: self.want(info) if info is not None else None)
        for info in list(registry.workers.values()):
            self.want(info)

    async def settled(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the fetches under way (a service about to take
        requests: a model whose tokenizer is on its way would answer 404 meanwhile)."""
        tasks = list(self._tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def close(self) -> None:
        await cancel_and_wait(list(self._tasks.values()))
