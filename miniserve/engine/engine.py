"""The Engine: one loaded model, one engine thread, a bounded queue and a prefix cache.

Every surface (web UI, CLI, API, benchmark) calls `Engine.chat` or `Engine.complete`,
so what the benchmark measures is what users get.

Prefix caching: after each request the KV cache is kept, keyed by the token ids it
holds. A new prompt that starts with the same tokens (the next turn of a chat) reuses the
longest matching cache and only prefills the rest; the same prompt again (a retried
request, Regenerate) needs no prefill at all.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from miniserve.core import heap
from miniserve.core.config import (
    KV_BUDGET,
    MAX_BATCH,
    MAX_QUEUE,
    STEP_TOKENS,
    ConfigError,
    SamplingParams,
)
from miniserve.core.errors import Busy
from miniserve.core.toolcalls import detect_format
from miniserve.engine.chat import (
    NO_OPTIONS,
    ChatError,
    ChatOptions,
    NoChatTemplate,
    calls_as_text,
    check_messages,
    completion_ids,
    has_chat_template,
    takes_tools,
    template_text,
    trim_history,
)
from miniserve.engine.decode import GenerationStats, LogitsObserver, crop_cache, generate
from miniserve.engine.grammar import Grammars, Lark
from miniserve.engine.reply import (
    ANSWER,
    CALL,
    CLOSE,
    END_THINK,
    OPEN,
    REASONING,
    THINK,
    CallParts,
    Markers,
    ReplyParts,
    ReplyPlan,
    ToolPlan,
    call_grammars,
    token_id,
)
from miniserve.engine.sampling import SamplerState
from miniserve.engine.scheduler import RequestTooLarge, Scheduler, Sequence  # noqa: F401
from miniserve.engine.stream import Detokenizer, StopStrings
from miniserve.engine.surface import LOCAL
from miniserve.runners import lean, native, stored
from miniserve.runners.hf import TransformersRunner
from miniserve.runners.loader import (
    KNOWN_MODELS,
    STORED,
    LoadedModel,
    ModelLoadError,
    describe,
    load_model,
    pick_device,
    resolve_source,
)
from miniserve.runners.stored import StoredRunner, quantize_at_load

END_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "</s>",
    "<end_of_turn>",
)
PROMPT_LOGITS_ROWS = 128  # prompt positions whose logits are held at once (echo + logprobs)


class EngineBusy(Busy, RuntimeError):
    """Too many requests are waiting; try again shortly."""


class EngineClosed(RuntimeError):
    """The engine was shut down while the request ran."""


class Admission:
    """Requests running or waiting, at most `max_queue`: past it, EngineBusy with `busy(n)`'s
    words. The local engine and the remote one (miniserve/models/remote.py) count the same way."""

    def __init__(self, busy):
        self.busy = busy
        self._lock = threading.Lock()
        self._in_flight = 0

    def admit(self, max_queue: int, n: int = 1) -> None:
        with self._lock:
            if self._in_flight + n > max_queue:
                raise EngineBusy(self.busy(self._in_flight))
            self._in_flight += n

    def release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    @property
    def in_flight(self) -> int:
        return self._in_flight


class Admitting:
    """The queue both engines keep: `_admission` (an Admission) and `max_queue`."""

    _admission: Admission
    max_queue: int

    def _admit(self, n: int = 1) -> None:
        self._admission.admit(self.max_queue, n)

    def _release(self) -> None:
        self._admission.release()

    @property
    def queue_depth(self) -> int:
        return self._admission.in_flight


@dataclass
class Chunk:
    """One streamed piece of a reply. The last one has `done=True`."""

    text: str
    token_ids: list[int]  # the ids of what it holds, in order (see _Reply)
    stats: GenerationStats
    done: bool = False
    dropped_messages: int = 0
    reasoning: str = ""  # this piece's reasoning text (a thinking model's, before its answer)
    tool_calls: list = field(default_factory=list)  # OpenAI's delta.tool_calls of this piece
    calls: list = field(default_factory=list)  # the last chunk: the reply's tool calls, whole
    # a chunk without text that says how far the prompt is read: its positions in the cache
    # (of stats.prompt_tokens), at admission and after each pass that read a part of it. Sent
    # only to a request that asked (complete's `progress`).
    prompt_read: int | None = None

    def reading(self) -> str | None:
        """A progress chunk's words ("reading the prompt: 512 of 1,554 tokens…"), else None."""
        if self.prompt_read is None:
            return None
        return f"reading the prompt: {self.prompt_read:,} of {self.stats.prompt_tokens:,} tokens…"


@dataclass
class _Entry:
    ids: tuple[int, ...]
    cache: object
    prompt_len: int = 0
    prompt_logits: object = None  # what the first ids[:prompt_len] produced, if known


@dataclass
class PrefixCache:
    """LRU of KV caches keyed by the ids they hold, bounded in entries and total tokens.

    An entry also keeps the logits its request's prompt produced. The same prompt again (a
    Regenerate, a retried request) then reuses all of it and those logits: no prefill, and
    the reply is computed exactly as the first one was. A prompt that only shares a prefix
    feeds the rest through the model: on the native runner exactly what a fresh prompt would
    compute (each position's numbers do not depend on how the prompt was cut); on the others,
    other shapes, so other rounding (tests/reference.py)."""

    max_entries: int = 4
    max_tokens: int = 32768
    min_match: int = 16
    entries: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)
    _next: int = 0

    def take(self, prompt: list[int]):
        """Remove and return (cache, n, logits) for the longest shared prefix: logits when the
        cache holds the whole prompt and what it produced, else None; or (None, 0, None)."""
        best, best_len, best_whole = None, 0, False
        for key, entry in self.entries.items():
            n = common_prefix(entry.ids, prompt)
            whole = n == len(prompt) == entry.prompt_len and entry.prompt_logits is not None
            if (n, whole) > (best_len, best_whole):
                best, best_len, best_whole = key, n, whole
        if not best_whole:  # the last prompt token must be fed for its logits
            best_len = min(best_len, len(prompt) - 1)
        if best is None or best_len < self.min_match:
            return None, 0, None
        entry = self.entries.pop(best)
        crop_cache(entry.cache, best_len)
        return entry.cache, best_len, entry.prompt_logits if best_whole else None

    def put(self, ids: list[int], cache, prompt_len: int = 0, prompt_logits=None) -> None:
        if self.max_entries <= 0 or not ids:
            return
        if len(ids) < prompt_len:  # stopped before the prompt was in: its logits are not
            prompt_logits = None
        prompt = tuple(ids[:prompt_len])
        for key in [
            k
            for k, e in self.entries.items()  # one entry per prompt: of the n
            if prompt_len and e.ids[:prompt_len] == prompt
        ]:  # choices, the last
            del self.entries[key]
        self.entries[self._next] = _Entry(tuple(ids), cache, prompt_len, prompt_logits)
        self._next += 1
        while len(self.entries) > self.max_entries or (
            len(self.entries) > 1 and self.total_tokens() > self.max_tokens
        ):
            self.entries.popitem(last=False)

    def total_tokens(self) -> int:
        return sum(len(e.ids) for e in self.entries.values())

    def held_positions(self) -> int:
        """KV positions the kept caches hold in memory (their capacity, where they say)."""
        return sum(max(e.cache.capacity, len(e.ids)) for e in self.entries.values())

    def clear(self) -> None:
        self.entries.clear()


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


RUNNERS = ("auto", "native", "lean", "transformers")
SPECULATE = ("off", "ngram")
QUANTS = ("q8_0", "q4_0")  # at load, into the native runner's blocks (stored.quantize_at_load)


def make_runner(
    loaded: LoadedModel, runner: str = "auto", quant: str | None = None, math: str = "auto"
):
    """The module the decode loop drives. transformers: the library model. lean: our readable
    PyTorch forward pass (Llama family). native: lean, with every pass in compiled code
    (miniserve/runners/native.py; CPU, float32 or bfloat16 weights). auto: the fastest that
    applies."""
    if runner not in RUNNERS:
        raise ValueError(f"unknown runner '{runner}': use {', '.join(RUNNERS)}")
    if loaded.stored:  # a GGUF's weights as stored: the native runner over the mapped file
        if runner not in ("auto", "native"):
            raise ValueError(
                f"the {runner} runner computes over dequantized weights: use "
                f"--dtype float32 or bfloat16 with --runner {runner}"
            )
        if quant:
            raise ValueError(
                f"--quant {quant} quantizes float weights at load; this GGUF's "
                "weights are used as stored (for --quant, add --dtype bfloat16)"
            )
        return StoredRunner(loaded.model, math, loaded.generation_config)
    if quant in QUANTS:  # a float model's matrices quantized to blocks at load (native)
        if runner not in ("auto", "native") or loaded.device.type != "cpu":
            instead = (
                f"--runner {runner}" if runner not in ("auto", "native") else loaded.device.type
            )
            raise ValueError(f"--quant {quant} runs on the native runner on the CPU, not {instead}")
        if not lean.supports(loaded.model):
            raise ValueError(
                f"--quant {quant} needs an architecture the native runner runs "
                f"(Llama family, Qwen2, Gemma 3), not {loaded.model.config.model_type}"
            )
        return quantize_at_load(loaded.model, quant, math)
    if quant and runner in ("transformers", "native"):
        raise ValueError(f"--quant needs the lean runner, not {runner}")
    if runner == "transformers" or (runner == "auto" and not lean.supports(loaded.model)):
        dtype = str(loaded.model.dtype).removeprefix("torch.")
        if math not in ("auto", dtype):
            raise ValueError(
                f"--math {math} needs the native runner; the transformers runner "
                f"computes in the weights' dtype ({dtype})"
            )
        return TransformersRunner(loaded.model)
    if not lean.supports(loaded.model):
        raise ValueError(
            f"the {runner} runner does not support "
            f"{loaded.model.config.model_type}; use --runner transformers"
        )
    if runner == "native" or (
        runner == "auto" and native.supports(loaded.device, loaded.model.dtype, quant)
    ):
        if quant:
            raise ValueError(f"--quant {quant} runs on the lean runner, not the native one")
        return native.NativeRunner(loaded.model, math=math)
    return lean.LeanRunner(loaded.model, quant=quant, math=math)


class Stream:
    """A request's chunks as an iterator. Closing it -- or dropping it, even before its first
    chunk -- cancels the request within one step."""

    def __init__(self, items: Iterator, cancel: threading.Event):
        self._items, self.cancel = items, cancel

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._items)

    def close(self) -> None:
        self.cancel.set()
        self._items.close()

    def __del__(self):
        self.cancel.set()


class _Edges:
    """A stream of text without its leading newlines, and with its trailing ones held back
    until more text follows (a reasoning block's text, as templates strip it)."""

    def __init__(self, hold_tail: bool = True):
        self.started, self.tail, self.hold_tail = False, "", hold_tail

    def feed(self, piece: str) -> str:
        if not self.started:
            piece = piece.lstrip("\n")
            self.started = bool(piece)
        if not self.hold_tail or not piece:
            return piece
        piece = self.tail + piece
        body = piece.rstrip("\n")
        self.tail = piece[len(body) :]
        return body


class _Reply:
    """Turns a sequence's token ids into Chunks for its caller: UTF-8-safe text, stop strings,
    a last chunk with the stats. With `parts` (a chat reply's ReplyParts), each token goes to
    its part: reasoning, answer, or a tool call; the tags themselves to none. Stop strings
    apply to the answer only.

    Each chunk carries the ids of what it holds, so that the ids the chunks carried so far are
    always the reply's first ones (the API's logprobs are theirs): an answer token goes out
    with the chunk that lets out the start of its text, and every token after one whose text
    is held back (it may become a stop string) waits with it; a tag, and a newline the answer's
    edges drop, go with the next chunk. The ids of the text a stop string removed go out in
    none."""

    def __init__(
        self,
        tokenizer,
        params: SamplingParams,
        stats: GenerationStats,
        sink,
        dropped_messages: int = 0,
        parts: ReplyParts | None = None,
        tool_format=None,
    ):
        self.tokenizer = tokenizer
        self.detok = Detokenizer(tokenizer)
        self.stops = StopStrings(params.stop)
        self.stats, self.sink, self.dropped = stats, sink, dropped_messages
        # ids not sent yet: [id, where it stands in the answer's text, whether it is the
        # answer's: its text may be held back or cut]
        self.pending: list[list] = []
        # the call tokens' entries, with where each token's text starts in the calls' text: a
        # call that does not parse comes back as the answer's text, and they are placed in it
        self.call_entries: list[tuple[list, int]] = []
        self.fed = 0  # characters of the answer given to the stop strings
        self.let_out = 0  # of them, those let out (not held back, not cut)
        self.parts = parts if parts is not None and parts.plan.split else None
        self.thought = Detokenizer(tokenizer)
        self.thought_edges, self.answer_edges = _Edges(), _Edges(hold_tail=False)
        self.reasoned = False
        self.calls = CallParts(tokenizer, tool_format) if tool_format is not None else None

    def _ready(self) -> int:
        """How many pending ids may go out: up to the first answer token whose text starts in
        what is held back (or cut), and any other token after held-back text."""
        for n, (_, at, answer) in enumerate(self.pending):
            if at > self.let_out or (answer and at == self.let_out):
                return n
        return len(self.pending)

    def _out(self) -> list[int]:
        n = self._ready()
        ids = [i for i, _, _ in self.pending[:n]]
        del self.pending[:n]
        return ids

    def _send(self, text: str = "", reasoning: str = "", tool_calls=()) -> None:
        if text or reasoning or tool_calls:
            self.sink(
                Chunk(
                    text, self._out(), self.stats, reasoning=reasoning, tool_calls=list(tool_calls)
                )
            )

    def _answer(self, piece: str) -> str:
        """The answer's text that may be shown now; where a stop string cuts it, the ids of
        the text it removed are dropped."""
        self.fed += len(piece)
        text = self.stops.feed(piece)
        self.let_out += len(text)
        if self.stops.stopped:
            del self.pending[self._ready() :]
        return text

    def prompt_read(self, positions: int) -> None:
        self.sink(Chunk("", [], self.stats, prompt_read=positions))

    def token(self, token_id: int) -> bool:
        """Take one token; False when a stop string ended the reply."""
        kind = self.parts.kinds[-1] if self.parts is not None and self.parts.kinds else ANSWER
        if kind == CALL and self.calls is None:  # no family to read calls by: answer text
            kind = ANSWER
        if kind != ANSWER:  # not the answer's: no stop string cuts it
            self.pending.append([token_id, self.fed, False])
        if kind == REASONING:
            self.reasoned = True
            self._send(reasoning=self.thought_edges.feed(self.thought.push(token_id)))
            return True
        if kind in (OPEN, CLOSE):
            self.reasoned = True
            if kind == CLOSE:
                self._send(reasoning=self.thought_edges.feed(self.thought.flush()))
            return True
        if kind == CALL:
            self.call_entries.append((self.pending[-1], len(self.calls.raw)))
            # no stop string reaches across a call (as none would across the call's own text):
            # the answer's text held back in case it became one goes out before the call
            held = self.stops.flush()
            self.let_out += len(held)
            self._send(held)
            self._send(tool_calls=self.calls.push(token_id))
            return True
        piece = self.detok.push(token_id)
        text = self.answer_edges.feed(piece) if self.reasoned else piece
        # a piece the edges drop is the template's, as a tag is; an empty one (a character
        # not complete yet) is the answer's
        self.pending.append([token_id, self.fed, bool(text) or not piece])
        self._send(self._answer(text))
        return not self.stops.stopped

    def finish(self, error: BaseException | None = None) -> None:
        if error is not None:
            self.sink(error)
            return
        if self.parts is not None:
            self.stats.reasoning_tokens = self.parts.reasoning_tokens
        reasoning = self.thought_edges.feed(self.thought.flush())
        deltas, calls, leftover = self.calls.finish() if self.calls is not None else ([], [], "")
        tail = ""
        if not self.stops.stopped:
            head = self.detok.flush()
            if leftover:  # the calls' text, given back as the answer's: their tokens are in it
                for entry, start in self.call_entries:
                    entry[1:] = [self.fed + len(head) + start, True]
            tail = self._answer(head + leftover)
            tail += self.stops.flush()
        if calls and self.stats.finish_reason in ("eos", "stop"):
            self.stats.finish_reason = "tool_calls"
        self.sink(
            Chunk(
                tail,
                [i for i, _, _ in self.pending],  # a stop string dropped those it removed
                self.stats,
                done=True,
                dropped_messages=self.dropped,
                reasoning=reasoning,
                tool_calls=deltas,
                calls=calls,
            )
        )


class Engine(Admitting):
    def __init__(
        self,
        loaded: LoadedModel,
        max_queue: int = MAX_QUEUE.default,
        prefix_cache_entries: int = 4,
        runner: str = "auto",
        quant: str | None = None,
        math: str = "auto",
        kv_budget: int | None = None,
        max_batch: int | None = None,
        step_tokens: int | None = None,
        name: str | None = None,
        reasoning_budget: int | None = None,
        speculate: str = "off",
    ):
        self.loaded = loaded
        self._name = name or loaded.name
        self.runner = make_runner(loaded, runner, quant, math)
        self.quant = quant
        self.tokenizer = loaded.tokenizer
        self.context_length = loaded.context_length
        self.eos_ids = frozenset(self._end_ids())
        self.prefix_cache = PrefixCache(max_entries=prefix_cache_entries)
        self.max_queue = max_queue
        self.scheduler = Scheduler(
            self.runner,
            prefix_cache=self.prefix_cache,
            max_batch=max_batch or MAX_BATCH.default,
            step_tokens=step_tokens or STEP_TOKENS.default,
            kv_budget=kv_budget or KV_BUDGET.default,
        )
        self._admission = Admission(
            lambda n: f"the server is busy ({n} requests running or waiting); try again in a moment"
        )
        self._grammars = None
        self._markers: Markers | None = None
        self._takes_tools: bool | None = None
        self.reasoning_budget = reasoning_budget  # the server's default (--reasoning-budget)
        if speculate not in SPECULATE:
            raise ValueError(f"--speculate {speculate!r}: use {', '.join(SPECULATE)}")
        self.speculate = speculate
        self._start_worker()
        heap.settle()  # what is loaded now stays out of full collections (core/heap.py)

    capabilities = LOCAL

    @property
    def name(self) -> str:
        return self._name

    @property
    def runner_name(self) -> str:
        """ "transformers", "lean" or "native" (runners/base.py)."""
        return self.runner.name

    @property
    def has_chat_template(self) -> bool:
        """False for a base model: it continues text (complete_text), chat raises."""
        return has_chat_template(self.tokenizer)

    @property
    def speculates(self) -> bool:
        """Prompt-lookup speculation is on and applies: the compiled runners only, whose rows
        do not depend on what shares their pass (so verifying k drafts in one pass gives the
        numbers k steps would); elsewhere it is off, and `speculation` says why."""
        return self.speculate == "ngram" and self.can_speculate

    @property
    def can_speculate(self) -> bool:
        return self.runner_name == "native"

    @property
    def speculation(self) -> str:
        if self.speculate == "off":
            return "off"
        if not self.speculates:
            return f"off (the {self.runner_name} runner is not batch-invariant)"
        return "ngram (prompt lookup)"

    def info(self) -> dict:
        s = self.scheduler
        return {
            **describe(self.loaded),
            "name": self.name,
            "chat": self.has_chat_template,
            "remote": False,
            "runner": self.runner_name,
            "quant": self.quant or "none",
            "compute_dtype": self.runner.math,
            "kernels": native.kernels_label() if self.runner_name == "native" else None,
            "max_batch": s.max_batch,
            "step_tokens": s.step_tokens,
            "kv_budget": s.kv_budget,
            "speculation": self.speculation,
        }

    def _end_ids(self) -> set[int]:
        ids = set()
        gen_eos = self.loaded.generation_config.eos_token_id
        ids.update(
            gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        )
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        ids.update(i for t in END_TOKENS if (i := token_id(self.tokenizer, t)) is not None)
        return ids

    # -- one engine thread runs every forward pass ------------------------------------------
    # All model work happens on this one long-lived thread: the scheduler's steps, and now and
    # then a job that needs the model alone (the benchmark's reference runs, a no-cache
    # generation), run between two steps. Measured on 2 CPU cores: decoding from a fresh
    # thread after another thread has used the OpenMP pool runs ~35% slower, so requests from
    # web, API and CLI threads are handed over here.
    def _start_worker(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="miniserve-engine", daemon=True)
        self._worker.start()

    def _work(self) -> None:
        while True:
            # Take what arrived: wait for it when idle, else only look between two steps.
            block = not self.scheduler.busy
            try:
                while True:
                    job = self._jobs.get(block=block)
                    block = False
                    if job is None:  # close()
                        self.scheduler.fail_all(EngineClosed("the engine was shut down"))
                        return
                    job()
            except queue.Empty:
                pass
            if self.scheduler.busy:
                try:
                    self.scheduler.step()
                except Exception as e:  # noqa: BLE001 -- never lose the engine thread
                    self.scheduler.fail_all(e)

    def close(self, timeout: float = 30.0) -> None:
        """End the engine thread after what is queued (sequences still running end with
        EngineClosed): a process exits cleanly, never in the middle of a pass."""
        if self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join(timeout)
        heap.thaw()  # its runner's cycles can go once it is dropped (core/heap.py)

    def run_on_worker(self, fn, *args, **kwargs):
        """Run fn on the engine thread, between two steps; return its result."""
        done = threading.Event()
        box = {}

        def job():
            try:
                box["result"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 -- re-raised in the caller
                box["error"] = e
            finally:
                done.set()

        self._jobs.put(job)
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["result"]

    # -- generation ------------------------------------------------------------------------
    @property
    def grammars(self):
        """The grammar compiler for this model's tokenizer (built on first use; a constraint
        compiled once is reused)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.eos_ids, self.runner.config.vocab_size)
        return self._grammars

    def check(self, params: SamplingParams) -> None:
        """What only the model can check in settings: logit-bias ids within its vocabulary
        (ConfigError), and an output format its tokenizer's grammar compiler can enforce
        (GrammarError with the library's reason; compiled once, reused by the replies)."""
        vocab = self.runner.config.vocab_size
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ConfigError(
                f"'logit_bias': token id {bad} is out of range: the vocabulary "
                f"has ids 0..{vocab - 1}",
                "logit_bias",
            )
        if params.constraint is not None:
            self.grammars.check(params.constraint)

    def sampler_state(self, prompt_len: int | None = None) -> SamplerState:
        """A new reply's sampling state: Mirostat's mu, its draws, this model's token texts
        (DRY's sequence breakers) and its prompt's length (where the reply's own tokens start:
        the presence and frequency penalties count those)."""
        return SamplerState(self._token_text, self.runner.config.vocab_size, prompt_len=prompt_len)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def matcher(self, params: SamplingParams):
        """A new grammar state for one reply under `params.constraint`, or None. Raises
        GrammarError (a ValueError naming the field and the library's reason) for a schema,
        pattern or grammar that cannot be used."""
        return None if params.constraint is None else self.grammars.matcher(params.constraint)

    def complete(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        cancel: threading.Event | None = None,
        use_cache: bool = True,
        reuse_prefix: bool = True,
        observer: LogitsObserver | None = None,
        dropped_messages: int = 0,
        plan: ReplyPlan | None = None,
        speculate: bool | None = None,
        progress: bool = False,
    ) -> Iterator[Chunk]:
        """Stream a reply to raw prompt ids: text pieces, then a final chunk with stats; with
        `progress`, chunks with `prompt_read` too while its prompt is read.

        The request joins the scheduler: it advances in the same forward passes as every
        other request. Closing the iterator early (a client went away) cancels it within one
        step. Without the KV cache (`use_cache=False`, the textbook loop kept for the
        benchmark) it runs alone between two steps."""
        cancel = cancel or threading.Event()
        out: queue.Queue = queue.Queue()
        if not use_cache:
            self._admit()

            def job():
                try:
                    self._solo_reply(
                        prompt_ids, params, cancel, observer, out.put, dropped_messages, plan
                    )
                finally:
                    self._release()

            self._jobs.put(job)
        else:
            self._start(
                [(prompt_ids, params, out.put)],
                cancel,
                reuse_prefix,
                observer,
                dropped_messages,
                plan,
                speculate,
                progress,
            )
        return Stream(drain(out, cancel), cancel)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink,
        *,
        cancel: threading.Event | None = None,
        reuse_prefix: bool = True,
        observer: LogitsObserver | None = None,
        plan: ReplyPlan | None = None,
        speculate: bool | None = None,
    ) -> threading.Event:
        """Start a request without a thread to read it: `sink(item)` is called on the engine
        thread with each Chunk, an exception if it failed, then None. It must return at once
        (e.g. hand the item to an event loop). Returns the event that cancels it."""
        cancel = cancel or threading.Event()
        self._start(
            [(prompt_ids, params, sink)], cancel, reuse_prefix, observer, 0, plan, speculate
        )
        return cancel

    def compare(
        self,
        prompt_ids: list[int],
        settings: list[SamplingParams],
        *,
        cancel: threading.Event | None = None,
    ) -> Iterator[tuple[int, Chunk, float]]:
        """Answer one prompt under several settings at once, as one batch: every step
        advances all the columns. Yields (column, chunk, that column's seconds so far)."""
        cancel = cancel or threading.Event()
        out: queue.Queue = queue.Queue()

        def column(col):
            return lambda item: out.put(
                item if item is None or isinstance(item, BaseException) else (col, item)
            )

        self._start(
            [(prompt_ids, p, column(i)) for i, p in enumerate(settings)], cancel, False, None, 0
        )
        return columns(out, cancel, len(settings))

    def compare_prompt(
        self,
        prompt: str,
        settings: list[SamplingParams],
        *,
        raw: bool = False,
        cancel: threading.Event | None = None,
    ):
        """compare() of one user message (raw: of a text to continue, completion mode)."""
        ids = (
            self.prompt_ids(prompt, settings[0])
            if raw
            else self.chat_prompt([{"role": "user", "content": prompt}], settings[0])
        )
        return self.compare(ids, settings, cancel=cancel)

    def _start(
        self,
        requests,
        cancel: threading.Event,
        reuse_prefix: bool,
        observer,
        dropped_messages: int,
        plan: ReplyPlan | None = None,
        speculate: bool | None = None,
        progress: bool = False,
    ) -> None:
        """Queue sequences for the scheduler: (prompt ids, params, sink) each. Admission
        happens now: a full queue raises EngineBusy, a request too large for the KV budget
        RequestTooLarge, before anything starts. Each sink gets Chunks, then None."""
        seqs = []
        for prompt_ids, params, sink in requests:
            prompt_ids = list(prompt_ids)
            if not prompt_ids:
                raise ValueError("the prompt is empty: give at least one token")
            vocab = self.runner.config.vocab_size
            bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(
                    f"token id {bad} is out of range: the vocabulary has ids 0..{vocab - 1}"
                )
            self.check(params)
            matcher = self.reply_matcher(params, plan)
            stats = GenerationStats(prompt_tokens=len(prompt_ids))
            reply = self._reply(params, stats, sink, dropped_messages, matcher, plan)

            def finish(error, reply=reply, sink=sink):
                try:
                    reply.finish(error)
                finally:
                    sink(None)
                    self._release()

            seq = Sequence(
                prompt_ids,
                params,
                min(params.max_new_tokens, self.context_length - len(prompt_ids)),
                reply.token,
                finish,
                self.eos_ids,
                cancel,
                observer,
                matcher,
                reuse_prefix,
                stats,
                # the request may switch speculation off, or on where the engine can do it
                speculate=self.speculates
                if speculate is None
                else speculate and self.can_speculate,
                sampler=self.sampler_state(len(prompt_ids)),
                on_prompt=reply.prompt_read if progress else None,
            )
            self.scheduler.check(seq)
            seqs.append(seq)
        self._admit(len(seqs))
        self._jobs.put(lambda: [self.scheduler.add(s) for s in seqs])

    def _solo_reply(self, prompt_ids, params, cancel, observer, sink, dropped_messages, plan):
        """The textbook loop without a KV cache, alone on the engine thread."""
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        matcher = self.reply_matcher(params, plan)
        reply = self._reply(params, stats, sink, dropped_messages, matcher, plan)
        try:
            if not cancel.is_set():  # a caller that left while queued costs nothing
                for token_id in generate(
                    self.runner,
                    prompt_ids,
                    params,
                    eos_ids=self.eos_ids,
                    use_cache=False,
                    cancel=cancel,
                    stats=stats,
                    max_length=self.context_length,
                    observer=observer,
                    matcher=matcher,
                    sampler=self.sampler_state(len(prompt_ids)),
                ):
                    if not reply.token(token_id):
                        stats.finish_reason = "stop"
                        break
            reply.finish()
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller
            reply.finish(e)
        finally:
            sink(None)

    def complete_text(
        self, prompt, params: SamplingParams, trim: bool = False, **kwargs
    ) -> Iterator[Chunk]:
        """Completion mode: stream the continuation of a text (or of token ids), no template.
        Too long for the context: ChatError, or with `trim` the oldest tokens dropped."""
        return self.complete(self.prompt_ids(prompt, params, trim=trim), params, **kwargs)

    def prompt_ids(
        self,
        prompt,
        params: SamplingParams,
        trim: bool = False,
        field: str = "prompt",
        new_tokens: int | None = None,
    ) -> list[int]:
        """The ids complete_text would send for `prompt` (a string or a list of ids), leaving
        room for `new_tokens` (params.max_new_tokens unless given: 0 to score it alone)."""
        return completion_ids(
            self.tokenizer,
            prompt,
            self.context_length,
            params.max_new_tokens if new_tokens is None else new_tokens,
            field,
            trim,
        )

    def prompt_logprobs(self, prompt_ids: list[int], top: int = 0) -> list[tuple]:
        """For each prompt position after the first: (logprob of the token that is there,
        [(id, logprob) of the `top` most likely]) -- what OpenAI's echo + logprobs returns.
        Computed on the engine thread in pieces of PROMPT_LOGITS_ROWS positions (a vocabulary
        of 262k makes all-position logits of a long prompt gigabytes), with a KV cache."""

        def run():
            cache = self.runner.new_cache(len(prompt_ids))
            out = []
            for start in range(0, len(prompt_ids) - 1, PROMPT_LOGITS_ROWS):
                piece = prompt_ids[start : start + PROMPT_LOGITS_ROWS]
                logits = self.runner.forward(torch.tensor([piece]), cache, all_logits=True)
                logp = torch.log_softmax(logits.float(), dim=-1)
                for row in range(len(piece)):
                    pos = start + row + 1  # this row predicts the token at pos
                    if pos >= len(prompt_ids):
                        break
                    alts = []
                    if top:
                        values, ids = logp[row].topk(top)
                        alts = list(zip(ids.tolist(), values.tolist()))
                    out.append((float(logp[row, prompt_ids[pos]]), alts))
            return out

        if len(prompt_ids) < 2:
            return []
        self._admit()  # a place in the queue like any request (EngineBusy past max_queue)
        try:
            return self.run_on_worker(run)
        finally:
            self._release()

    def chat(
        self,
        messages: list[dict],
        params: SamplingParams,
        options: ChatOptions | None = None,
        **kwargs,
    ) -> Iterator[Chunk]:
        """Stream the assistant's reply to a conversation, trimmed to fit the context."""
        trimmed = self.trim(messages, params, options)
        return self.complete(
            trimmed.prompt_ids,
            params,
            dropped_messages=trimmed.dropped,
            plan=trimmed.plan,
            **kwargs,
        )

    def trim(
        self, messages: list[dict], params: SamplingParams, options: ChatOptions | None = None
    ):
        """Check the messages and drop the oldest turns until the reply fits the context; and
        plan the reply (Trimmed.plan: where it starts, what steers it). A model without a
        chat template: NoChatTemplate (a ChatError)."""
        if not self.has_chat_template:
            raise NoChatTemplate(self.name)
        options = self.chat_options(options)
        if options.tools and options.tool_choice == "none" and not self.takes_tools:
            # tools this model's template cannot show, which the reply may not call anyway: a
            # client that sends its tools with every request gets its plain reply
            options = dataclasses.replace(options, tools=[])
        tools = self.tool_plan(options)
        messages = check_messages(messages)
        if not self.takes_tools:  # earlier calls as text, else the template drops them
            messages = calls_as_text(messages)
        trimmed = trim_history(
            self.tokenizer,
            messages,
            self.context_length,
            params.max_new_tokens,
            options,
        )
        trimmed.plan = self.reply_plan(trimmed.messages, options, tools)
        return trimmed

    def chat_prompt(
        self, messages: list[dict], params: SamplingParams, options: ChatOptions | None = None
    ) -> list[int]:
        """The prompt ids `chat` would send (checked and trimmed)."""
        return self.trim(messages, params, options).prompt_ids

    # -- thinking and tools ------------------------------------------------------------------
    @property
    def markers(self) -> Markers:
        if self._markers is None:
            self._markers = Markers.of(self.tokenizer)
        return self._markers

    @property
    def thinks(self) -> bool:
        """Whether the model's template writes reasoning (its tokenizer has the tags)."""
        template = getattr(self.tokenizer, "chat_template", None) or ""
        return self.markers.thinking and THINK in template

    @property
    def thinking_switch(self) -> bool:
        """Whether the template turns thinking off itself (`enable_thinking`); else off is a
        reasoning budget of 0."""
        return self.thinks and "enable_thinking" in (self.tokenizer.chat_template or "")

    @property
    def takes_tools(self) -> bool:
        if self._takes_tools is None:
            self._takes_tools = self.has_chat_template and takes_tools(self.tokenizer)
        return self._takes_tools

    @property
    def tool_format(self):
        """The family's call format its template asks for (core/toolcalls.py), or None."""
        return detect_format(self.tokenizer.chat_template or "") if self.takes_tools else None

    def chat_options(self, options: ChatOptions | None) -> ChatOptions:
        """The options with the server's reasoning budget where the request set none, and
        thinking off as a budget of 0 where the template has no switch of its own."""
        options = options or NO_OPTIONS
        budget = options.reasoning_budget
        if budget is None:
            budget = self.reasoning_budget
        if options.thinking is False and self.thinks and not self.thinking_switch:
            budget = 0
        if budget == options.reasoning_budget:
            return options
        return dataclasses.replace(options, reasoning_budget=budget)

    def tool_plan(self, options: ChatOptions) -> ToolPlan | None:
        """The calls a reply may make; ChatError naming the field for tools this model's
        template cannot show, or a tool_choice that cannot be met."""
        choice = options.tool_choice
        if not options.tools:
            if choice not in ("auto", "none"):
                raise ChatError(f"'tool_choice': {choice!r} needs 'tools'", "tool_choice")
            return None
        if not self.takes_tools:
            raise ChatError(
                f"model '{self.name}' does not take tools: its chat template does not show "
                "them to the model",
                "tools",
            )
        names = [t["function"]["name"] for t in options.tools]
        if choice not in ("auto", "none", "required") and choice not in names:
            raise ChatError(
                f"'tool_choice' names the function {choice!r}, which is not among 'tools' "
                f"({', '.join(names)})",
                "tool_choice",
            )
        fmt = self.tool_format
        opener = token_id(self.tokenizer, fmt.opener) if fmt is not None else None
        closer = token_id(self.tokenizer, fmt.closer) if fmt is not None and fmt.closer else None
        if opener is None and choice not in ("auto", "none"):
            raise ChatError(
                f"'tool_choice': {choice!r} needs a call format this server knows; model "
                f"'{self.name}' writes its calls in another",
                "tool_choice",
            )
        one = calls = ""
        if opener is not None:
            only = None if choice in ("auto", "none", "required") else choice
            one, calls = call_grammars(
                fmt.name, options.tools, opener, closer, only, options.parallel_tool_calls
            )
            try:  # compiled once here, so a bad parameters schema is the request's error
                self.grammars.check(Lark(calls))
                self.grammars.check(Lark(one))
            except ValueError as e:
                raise ChatError(
                    f"'tools': a function's parameters cannot be used: {e}", "tools"
                ) from None
        return ToolPlan(
            fmt.name if fmt else "", opener, closer, choice, options.parallel_tool_calls, one, calls
        )

    def reply_plan(
        self, messages: list[dict], options: ChatOptions, tools: ToolPlan | None
    ) -> ReplyPlan:
        """Where the reply starts (inside reasoning when the generation prompt opened it) and
        what steers it."""
        in_reasoning = think_first = think_off = False
        if self.thinks and messages and messages[-1]["role"] != "assistant":
            whole = template_text(self.tokenizer, messages, options)
            before = template_text(self.tokenizer, messages, options, generation=False)
            opened = whole[len(before) :] if whole.startswith(before) else ""
            in_reasoning = THINK in opened and opened.rfind(THINK) > opened.rfind(END_THINK)
            think_off = options.thinking is False or (not in_reasoning and END_THINK in opened)
            think_first = not in_reasoning and not think_off
        return ReplyPlan(
            self.markers if self.thinks else Markers(),
            in_reasoning,
            think_first,
            think_off,
            options.reasoning_budget if self.thinks else None,
            tools,
        )

    def reply_matcher(self, params: SamplingParams, plan: ReplyPlan | None):
        """What steers a reply: its ReplyParts where it has parts (a thinking model, tools),
        else its output format's matcher (or None)."""
        if plan is None or not plan.split:
            return self.matcher(params)
        tools = plan.tools  # the grammars are built at their first use, not for every reply
        answer = (lambda: self.grammars.matcher(params.constraint)) if params.constraint else None
        call = calls = None
        if tools is not None and tools.opener is not None:
            call = lambda: self.grammars.matcher(Lark(tools.one_call))  # noqa: E731
            calls = lambda: self.grammars.matcher(Lark(tools.calls))  # noqa: E731
        return ReplyParts(plan, self.eos_ids, answer, call, calls)

    def _reply(self, params, stats, sink, dropped, matcher, plan) -> _Reply:
        parts = matcher if isinstance(matcher, ReplyParts) else None
        tools = plan.tools if plan is not None else None
        fmt = self.tool_format if tools is not None and tools.opener is not None else None
        return _Reply(self.tokenizer, params, stats, sink, dropped, parts, fmt)

    def chat_text(
        self, messages: list[dict], params: SamplingParams, **kwargs
    ) -> tuple[str, Chunk]:
        """The whole reply at once (collects `chat`)."""
        parts, last = [], None
        for last in self.chat(messages, params, **kwargs):
            parts.append(last.text)
        return "".join(parts), last

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def warm_up(self) -> float:
        """One tiny generation so the first user request does not pay one-off costs."""
        start = time.perf_counter()
        for _ in self.complete(
            self.tokenizer("Hello")["input_ids"],
            SamplingParams(temperature=0, max_new_tokens=2),
            reuse_prefix=False,
        ):
            pass
        return time.perf_counter() - start


def drain(out: queue.Queue, cancel: threading.Event, ends: int = 1) -> Iterator:
    """What the sinks of `ends` requests put in `out` (items, an exception, then None each),
    until every one ended; an exception is raised. Leaving early sets `cancel` (a no-op when
    all finished; else it stops the requests still running)."""
    try:
        while ends:
            item = out.get()
            if item is None:
                ends -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        cancel.set()


def columns(out: queue.Queue, cancel: threading.Event, n: int) -> Stream:
    """Compare's stream over `n` columns' sinks, each item (column, chunk): (column, chunk,
    the column's seconds so far) -- for the local engine and the remote one alike."""
    return Stream(
        ((col, chunk, chunk.stats.total_s) for col, chunk in drain(out, cancel, n)), cancel
    )


def auto_dtype(
    dtype: str, device: str | None, runner: str, quant: str | None, source: str | None = None
) -> str:
    """--dtype auto picks the fastest weights for what will run them: a GGUF's weights as
    stored where the native runner runs (fewer bytes a token than any float copy: Q4_K_M ~4.9
    bits a weight against bfloat16's 16; BENCHMARKS.md, "Weights as stored"); int8 runs with
    bfloat16 activations; the native CPU step reads bfloat16 weights (half the bytes of
    float32) and computes in float32, 1.3-1.6x faster than float32 weights here."""

    if dtype != "auto":
        return dtype
    if quant in ("int8", *QUANTS):  # quantized from bfloat16 (what published weights are)
        return "bfloat16"
    try:
        dev = pick_device(device)
    except ModelLoadError:
        return dtype  # load_model reports the bad device
    if runner in ("auto", "native") and native.supports(dev, torch.bfloat16):
        return STORED if quant is None and runs_as_stored(source) else "bfloat16"
    return dtype


def is_gguf(source: str | None) -> bool:
    """Whether a model source is a GGUF file (the embedded model and known models are)."""
    if not source or source == "default" or source in KNOWN_MODELS:
        return True
    try:
        return resolve_source(source)[0] == "gguf"
    except ModelLoadError:
        return False


def runs_as_stored(source: str | None) -> bool:
    """A GGUF whose architecture the stored runner runs (others load dequantized, through
    transformers, which says what it supports)."""
    if not is_gguf(source):
        return False
    if not source or source == "default" or source in KNOWN_MODELS:
        return True
    try:
        return stored.runs_as_stored(resolve_source(source)[1])
    except ModelLoadError:
        return True


def start_engine(
    model: str | None = None,
    device: str | None = "auto",
    dtype: str = "auto",
    runner: str = "auto",
    quant: str | None = None,
    progress=None,
    math: str = "auto",
    kv_budget: int | None = None,
    max_queue: int = MAX_QUEUE.default,
    max_batch: int | None = None,
    name: str | None = None,
    reasoning_budget: int | None = None,
    speculate: str = "off",
) -> Engine:
    """Load a model and start its engine, as the app, the CLI and `serve` do. Raises
    ModelLoadError (the model) or ValueError (the runner / quantization)."""
    pick_device(device)  # a device that is not there: said first, alone
    chosen = auto_dtype(dtype, device, runner, quant, model)
    if dtype == "auto" and chosen != "stored" and is_gguf(model) and runs_as_stored(model):
        why = (
            f"--runner {runner}"
            if runner not in ("auto", "native")
            else f"--quant {quant}"
            if quant
            else native.unavailable_reason() or "the native runner does not run on this device"
        )
        (progress or (lambda m: print(m, file=sys.stderr, flush=True)))(
            f"The GGUF's weights are dequantized ({why}); as stored they need the native "
            "runner on the CPU."
        )
    loaded = load_model(model, device=device, dtype=chosen, progress=progress)
    return Engine(
        loaded,
        runner=runner,
        quant=quant,
        math=math,
        kv_budget=kv_budget,
        max_queue=max_queue,
        max_batch=max_batch,
        name=name,
        reasoning_budget=reasoning_budget,
        speculate=speculate,
    )
