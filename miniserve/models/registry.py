"""Several models in one app: which ones it serves, which are loaded, and the way to each.

    --model SRC            (repeatable; the first is the default, `model: "default"` in the API)
    --model NAME=SRC       the same, named NAME in the dropdown and the API
    --model http://HOST:PORT/v1#served-name    a remote OpenAI-compatible server
    (miniserve/models/remote.py)
    --models-file models.yaml                  the same list as a file (see README)

A local model loads on first use (the first request that names it, or at start for the
default), with its progress reported to whoever asked, and gets its own engine: its own
tokenizer, context length, KV budget and engine thread. At most `max_loaded` local models stay
loaded; loading one more unloads the least recently used one that nothing is using (a request
in flight, or a `use()` block). Remote models cost nothing to keep.

Every surface asks this registry for an engine by name: `models.get(name)` or, to keep it from
being unloaded while a reply streams, `with models.use(name) as engine:`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from miniserve.core import heap
from miniserve.core.config import MAX_LOADED_MODELS, MAX_QUEUE
from miniserve.core.errors import NotServed, UserError
from miniserve.engine.engine import start_engine
from miniserve.models.remote import RemoteEngine
from miniserve.runners.loader import EMBEDDED_NAME, KNOWN_MODELS

# names the API takes for "the default model" (clients send these without asking /v1/models)
PLACEHOLDER_MODELS = {"default", "miniserve", "gpt-3.5-turbo", "gpt-4", "gpt-4o", "gpt-4o-mini"}


class UnknownModel(NotServed, LookupError):
    """A model name that this app does not serve; the message lists the ones it does."""

    def __init__(self, name: str, served: list[str]):
        self.name, self.served = name, served
        super().__init__(f"model '{name}' is not served here; choose one of: {', '.join(served)}")

    def __str__(self) -> str:  # LookupError would quote the message
        return self.args[0]


class ModelSpecError(UserError, ValueError):
    """A --model value or a models.yaml entry that cannot be used; the message says which."""


@dataclass(frozen=True)
class ModelSpec:
    name: str  # the dropdown's and the API's name
    source: str | None  # a local source (loader.resolve_source) or the server's URL
    remote: bool = False
    served_name: str | None = None  # remote: the model to ask the server for (after '#')
    context: int | None = None  # remote: the context, if the server does not say
    api_key: str | None = None  # remote: the server's key (not this server's --api-key)


def is_url(source: str | None) -> bool:
    return (
        bool(source) and source.split("://", 1)[0].lower() in ("http", "https") and "://" in source
    )


def default_name(source: str | None) -> str:
    """The name a model is listed under when none is given: what the loader will call it."""
    if not source or source == "default":
        return EMBEDDED_NAME
    if source in KNOWN_MODELS:
        return source
    if is_url(source):
        url, _, served = source.partition("#")
        return served or url.split("://", 1)[1].split("/", 1)[0]
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        return path.stem
    return path.name if path.is_dir() else source


def parse_spec(text: str, context: int | None = None, api_key: str | None = None) -> ModelSpec:
    """One --model value: SRC, NAME=SRC, or URL[#served-name]."""
    text = text.strip()
    if not text:
        raise ModelSpecError(
            "--model is empty: give a .gguf file, a folder, a Hugging Face id, a URL or default"
        )
    name = None
    head, eq, tail = text.partition("=")
    if eq and "://" not in head and "/" not in head and head.strip():
        name, text = head.strip(), tail.strip()
        if not text:
            raise ModelSpecError(f"--model {name}=: give the source after '='")
    return _spec(name, text, context, api_key)


def _spec(name: str | None, text: str, context: int | None, api_key: str | None) -> ModelSpec:
    if is_url(text):
        import httpx

        try:
            httpx.URL(text.partition("#")[0])
        except Exception as e:  # noqa: BLE001 -- httpx.InvalidURL and friends
            raise ModelSpecError(f"'{text}' is not a valid URL: {e}") from None
        url, _, served = text.partition("#")
        return ModelSpec(
            name or default_name(text), url.rstrip("/"), True, served or None, context, api_key
        )
    return ModelSpec(name or default_name(text), text)


def load_specs_file(
    path: str, context: int | None = None, api_key: str | None = None
) -> list[ModelSpec]:
    """models.yaml: a list of entries, each a source string or a mapping with `source` and
    optionally `name`, `context` (remote) and `api_key_env` (remote: the variable holding the
    server's key)."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ModelSpecError(f"--models-file {path}: cannot be read ({e})") from None
    entries = data.get("models") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ModelSpecError(
            f"--models-file {path}: expected a list of models (or 'models:' with a list)"
        )
    specs = []
    for i, entry in enumerate(entries, 1):
        where = f"--models-file {path}, entry {i}"
        if isinstance(entry, str):
            specs.append(parse_spec(entry, context, api_key))
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("source"), str):
            raise ModelSpecError(
                f"{where}: each entry is a source string or a mapping with 'source'"
            )
        unknown = set(entry) - {"source", "name", "context", "api_key_env"}
        if unknown:
            raise ModelSpecError(
                f"{where}: unknown key(s) {', '.join(sorted(unknown))} "
                "(allowed: source, name, context, api_key_env)"
            )
        ctx = entry.get("context", context)
        if ctx is not None and (not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 16):
            raise ModelSpecError(f"{where}: 'context' must be a whole number of at least 16")
        name, key_env = entry.get("name"), entry.get("api_key_env")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise ModelSpecError(f"{where}: 'name' must be a non-empty string")
        if key_env is not None and not isinstance(key_env, str):
            raise ModelSpecError(
                f"{where}: 'api_key_env' must be the name of an environment variable"
            )
        if not entry["source"].strip():
            raise ModelSpecError(f"{where}: 'source' is empty")
        key = os.environ.get(key_env) if key_env else api_key
        specs.append(_spec(name.strip() if name else None, entry["source"].strip(), ctx, key))
    return specs


def check_specs(specs: list[ModelSpec]) -> list[ModelSpec]:
    if not specs:
        raise ModelSpecError("no model given")
    seen = set()
    for spec in specs:
        if spec.name in seen:
            raise ModelSpecError(
                f"two models are named '{spec.name}': name one of them with --model NAME=SOURCE"
            )
        seen.add(spec.name)
    return specs


class Models:
    """The models an app serves, loaded on demand, at most `max_loaded` local ones at once.

    `factory(spec, progress)` makes a started engine (miniserve.engine.engine.start_engine for local
    sources, miniserve.models.remote.RemoteEngine for URLs)."""

    def __init__(
        self,
        specs: list[ModelSpec],
        factory: Callable,
        max_loaded: int = int(MAX_LOADED_MODELS.default),
        max_queue: int | None = None,
    ):
        self.specs: OrderedDict[str, ModelSpec] = OrderedDict(
            (s.name, s) for s in check_specs(list(specs))
        )
        self.factory = factory
        self.max_loaded = max_loaded
        self.max_queue = max_queue  # each engine's (--max-queue), known before any loads
        self._engines: OrderedDict[str, object] = OrderedDict()  # least recently used first
        self._leases: dict[str, int] = {}
        self._lock = threading.RLock()
        self._loading: dict[str, threading.Lock] = {name: threading.Lock() for name in self.specs}

    @classmethod
    def single(cls, engine) -> Models:
        """A registry of one engine already started (tests, embedding)."""
        models = cls([ModelSpec(engine.name, None)], factory=None)
        models._engines[engine.name] = engine
        return models

    @staticmethod
    def of(engine_or_models) -> Models:
        return (
            engine_or_models
            if isinstance(engine_or_models, Models)
            else Models.single(engine_or_models)
        )

    # -- names ---------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.specs)

    @property
    def default(self) -> str:
        return next(iter(self.specs))

    def resolve(self, name: str | None) -> str:
        """The served name for what a caller asked for (None and placeholders: the default)."""
        if name is None or name == "" or name in PLACEHOLDER_MODELS and name not in self.specs:
            return self.default
        if name in self.specs:
            return name
        raise UnknownModel(name, self.names)

    def is_loaded(self, name: str) -> bool:
        return name in self._engines

    def loaded(self) -> list[str]:
        return list(self._engines)

    def loaded_engine(self, name: str | None = None):
        """The engine if it is loaded, else None (never loads)."""
        return self._engines.get(self.resolve(name))

    def describe(self) -> list[dict]:
        """What /v1/models and the dropdowns show: every served model, loaded or not."""
        out = []
        for name, spec in self.specs.items():
            engine = self._engines.get(name)
            out.append(
                {
                    "name": name,
                    "remote": spec.remote,
                    "loaded": engine is not None,
                    "source": spec.source,
                    "default": name == self.default,
                    "context_length": engine.context_length if engine is not None else spec.context,
                }
            )
        return out

    # -- engines -------------------------------------------------------------------------
    def get(self, name: str | None = None, progress: Callable[[str], None] | None = None):
        """The engine of a model, loaded now if it is not (raises UnknownModel, or what
        loading raises: ModelLoadError, ValueError)."""
        name = self.resolve(name)
        with self._lock:
            engine = self._engines.get(name)
            if engine is not None:
                self._engines.move_to_end(name)
                return engine
        with self._loading[name]:  # one load of a model at a time; others wait for it
            with self._lock:
                engine = self._engines.get(name)
                if engine is not None:
                    self._engines.move_to_end(name)
                    return engine
            spec = self.specs[name]
            engine = self.factory(spec, progress)
            with self._lock:
                self._engines[name] = engine
                self._engines.move_to_end(name)
            if not spec.remote:  # after the load: one that fails unloads nothing
                self._make_room(keep=name)
            return engine

    @contextlib.contextmanager
    def use(self, name: str | None = None, progress=None) -> Iterator:
        """`with models.use(name) as engine:` -- the engine is not unloaded inside the block."""
        name = self.resolve(name)
        with self._lock:
            self._leases[name] = self._leases.get(name, 0) + 1
        try:
            yield self.get(name, progress)
        finally:
            with self._lock:
                self._leases[name] -= 1
                over = sum(not self.specs[n].remote for n in self._engines) > self.max_loaded
            if over:  # loaded past the limit while this one was busy: unload what is idle
                # now, on a thread of its own (unloading joins an engine thread; this may be
                # the event loop)
                newest = next(reversed(self._engines), name)
                threading.Thread(target=self._make_room, args=(newest,), daemon=True).start()

    def _busy(self, name: str) -> bool:
        engine = self._engines[name]
        return self._leases.get(name, 0) > 0 or engine.queue_depth > 0

    def _make_room(self, keep: str, adding: int = 0) -> None:
        """Unload least recently used idle local models (never `keep`) until at most
        max_loaded remain, counting `adding` more to come. When the others are busy, the limit
        is passed until one is idle: a request is never refused for memory that a finished
        one will free."""
        gone = []
        with self._lock:
            local = [n for n in self._engines if not self.specs[n].remote]
            excess = len(local) + adding - self.max_loaded
            for name in local:
                if excess <= 0:
                    break
                if name != keep and not self._busy(name):
                    gone.append(self._engines.pop(name))
                    excess -= 1
        self._close(gone)  # outside the lock: closing joins an engine thread

    def unload(self, name: str) -> bool:
        with self._lock:
            gone = [self._engines.pop(name)] if name in self._engines else []
        found = bool(gone)
        self._close(gone)
        return found

    @staticmethod
    def _close(engines: list) -> None:
        """Close `engines` and empty the list, then collect and freeze again (core/heap.py):
        the weights go now, before the next model's load needs the memory. No reference to
        an engine may be left here when the collection runs: a runner sits in reference
        cycles, and one frozen alive would stay once dropped."""
        if not engines:
            return
        while engines:
            engines.pop().close()
        heap.settle()

    def close(self) -> None:
        for name in list(self._engines):
            self.unload(name)


def timed_get(models: Models, name: str | None, progress=None) -> tuple[object, float]:
    """(engine, seconds it took to get it: ~0 when loaded)."""
    start = time.perf_counter()
    engine = models.get(name, progress)
    return engine, time.perf_counter() - start


@dataclass
class EngineOptions:
    """How local models are run (the --device/--dtype/--runner/... flags), the same for each."""

    device: str | None = "auto"
    dtype: str = "auto"
    runner: str = "auto"
    quant: str | None = None
    math: str = "auto"
    kv_budget: int | None = None
    max_queue: int | None = None
    max_batch: int | None = None
    reasoning_budget: int | None = None  # None: no limit
    speculate: str = "off"


def engine_factory(options: EngineOptions):
    """factory(spec, progress) for Models: a local engine (miniserve.engine.engine.start_engine) or
    a
    remote one (miniserve.models.remote.RemoteEngine)."""

    def make(spec: ModelSpec, progress=None):
        max_queue = options.max_queue or int(MAX_QUEUE.default)
        if spec.remote:
            return RemoteEngine(spec, max_queue=max_queue, progress=progress)
        engine = start_engine(
            spec.source,
            device=options.device,
            dtype=options.dtype,
            runner=options.runner,
            quant=options.quant,
            progress=progress,
            math=options.math,
            kv_budget=options.kv_budget,
            max_queue=max_queue,
            max_batch=options.max_batch,
            name=spec.name,
            reasoning_budget=options.reasoning_budget,
            speculate=options.speculate,
        )
        try:
            engine.warm_up()
        except BaseException:  # its thread holds the weights: end it, or they are never freed
            engine.close()
            raise
        return engine

    return make


def open_models(
    sources: list[str] | None,
    models_file: str | None = None,
    options: EngineOptions | None = None,
    max_loaded: int | None = None,
    context: int | None = None,
    remote_api_key: str | None = None,
) -> Models:
    """The registry the flags name: --model (repeatable) and/or --models-file, in that order;
    nothing: the embedded model. Nothing is loaded yet (ModelSpecError for a bad entry)."""
    specs = [parse_spec(s, context, remote_api_key) for s in sources or []]
    if models_file:
        specs += load_specs_file(models_file, context, remote_api_key)
    if not specs:
        specs = [parse_spec("default")]
    options = options or EngineOptions()
    return Models(
        specs,
        engine_factory(options),
        max_loaded or int(MAX_LOADED_MODELS.default),
        options.max_queue,
    )
