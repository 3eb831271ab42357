"""The Benchmark tab: no-cache vs KV cache vs `generate()` over several prompt lengths, and
several streams at once (concurrency); the same code as `python -m miniserve bench`. The Model
dropdown picks the engine measured; both benchmarks time this machine's own engine (its runners,
KV cache and scheduler), so a model served by a remote server is not measured here."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import gradio as gr
import pandas as pd

from miniserve.bench.bench import (
    GREEDY,
    BenchConfig,
    BenchStopped,
    ConcurrencyConfig,
    describe_concurrency,
    describe_run,
    run_bench,
    run_concurrency,
    to_dict,
)
from miniserve.core.config import ConfigError, SamplingParams
from miniserve.engine.engine import Engine
from miniserve.models.registry import Models
from miniserve.ui.common import (
    BENCHMARK_EVENTS,
    USER_ERRORS,
    ModelUnavailable,
    Sessions,
    counts_from,
    error,
    user_message,
)
from miniserve.ui.model_picker import build_model_picker, follow_picker, using
from miniserve.ui.widgets import whole

if TYPE_CHECKING:
    from miniserve.ui import TabContext

# The tables' columns: the result rows' fields (what the plots read, and what `bench --json`
# and `--csv` write) and the header a person reads, units included. The tables show their
# headers before the first run.
BENCH_COLUMNS = {
    "prompt_tokens": "Prompt tokens",
    "mode": "Mode",
    "dtype": "Weights",
    "new_tokens": "New tokens",
    "ttft_s": "First token (s)",
    "decode_tokens_per_s": "Decode tokens/s",
    "total_s": "Total (s)",
    "speedup_vs_no_cache": "Speed-up vs no cache (×)",
    "effective_gb_s": "Weights read (GB/s)",
    "tokens_match": "Same tokens as the first mode",
    "agree_tokens": "Leading tokens in agreement",
    "verified": "Follows the reference",
}
CONCURRENCY_COLUMNS = {
    "preset": "Preset",
    "concurrency": "Streams at once",
    "aggregate_tokens_per_s": "Aggregate tokens/s",
    "stream_decode_tokens_per_s": "Per-stream decode tokens/s",
    "ttft_p50_s": "First token p50 (s)",
    "ttft_p95_s": "First token p95 (s)",
    "itl_p95_s": "Inter-token p95 (s)",
    "ceiling_share": "Share of the ceiling",
    "ceiling_tokens_per_s": "Ceiling tokens/s",
    "produced_tokens": "Tokens produced",
    "asked_tokens": "Tokens asked",
    "dtype": "Weights",
}
CONCURRENCY_PRESETS = (GREEDY, "balanced")


def shown(rows: list[dict], columns: dict[str, str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A result's rows as (the table: `columns`' fields under their headers, in that order;
    the plot's data: the rows with their fields' names)."""
    data = pd.DataFrame(rows)
    return data[list(columns)].rename(columns=columns), data


def empty_table(columns: dict[str, str]) -> pd.DataFrame:
    """A table before its first run: the headers, no rows."""
    return pd.DataFrame(columns=list(columns.values()))


def remote_note(name: str) -> str:
    """Why a remote model is not benchmarked here, and what measures it."""
    return (
        f"model '{name}' runs on a remote server: these benchmarks time this machine's own "
        "engine (its runners, KV cache and scheduler), so they do not apply to it. Only a "
        "measurement at the client applies: the first-token time and tokens/s that Chat, "
        "Notebook and Compare show for each of its replies"
    )


BENCH = "bench"  # the kind of this tab's runs (Sessions)


class Trend(gr.LinePlot):
    """A line plot that draws points when its data has one x (one prompt length, one level of
    streams): a line needs two, and such a run drew an empty chart."""

    def postprocess(self, value):
        data = super().postprocess(value)
        if data is not None and isinstance(value, pd.DataFrame) and value[self.x].nunique() < 2:
            data = data.model_copy(update={"mark": "point"})
        return data


class BenchmarkHandlers:
    """The Benchmark tab's handlers over the app's models. Each takes the Model dropdown last
    (None: the default model) and returns (table, plot data, status): the table with the
    headers a person reads (BENCH_COLUMNS, CONCURRENCY_COLUMNS), the plot's data with the
    result's field names; on a bad value, a model that cannot be loaded or a remote one
    (None, None, the error)."""

    def __init__(
        self,
        models: Models | Engine,
        presets: dict[str, SamplingParams] | None = None,
        sessions: Sessions | None = None,
    ):
        self.models = Models.of(models)
        # the app's browser sessions' runs: Stop (this tab's, or any tab's) and a closed page
        # end a run of this session
        self.sessions = sessions or Sessions()
        # the app's presets (from its --presets-file), which the concurrency run uses; None:
        # the default presets.yaml
        self.presets = presets
        # what the concurrency run may name: `greedy` (built in) and the app's presets
        self.preset_names = list(dict.fromkeys([GREEDY, *(presets or {})]))

    @contextmanager
    def measured(self, model, progress):
        """The engine of a local model, held (`using`) while it is measured; a model not loaded
        yet loads first, its progress on the progress bar. Raises USER_ERRORS for a model not
        served or not loadable, and for a remote one (said before connecting to it)."""
        name = self.models.resolve(model)
        if self.models.specs[name].remote:
            raise ConfigError(remote_note(name), "model")
        if not self.models.is_loaded(name):
            progress(0, desc=f"loading model {name}…")
            try:
                self.models.get(
                    name, progress=lambda m: progress(0, desc=f"loading model {name}: {m}")
                )
            except Exception as e:  # noqa: BLE001 -- the tab's error line
                raise ModelUnavailable(name, e) from e
        with using(self.models, name) as engine:
            if not engine.capabilities.local_tokens:
                raise ConfigError(remote_note(name), "model")
            yield engine

    def benchmark(
        self,
        lengths_text,
        new_tokens,
        repeat,
        model=None,
        progress=gr.Progress(),
        request: gr.Request | None = None,
    ):
        def setup():
            lengths = counts_from(lengths_text, "Prompt lengths", "32,128,512")
            config = BenchConfig(
                prompt_tokens=lengths, new_tokens=whole(new_tokens), repeat=whole(repeat)
            )
            return lambda engine, tick, cancel: run_bench(engine, config, tick, cancel)

        return self._measure(setup, model, progress, request, BENCH_COLUMNS, describe_run)

    def concurrency(
        self,
        levels_text,
        presets,
        prompt_tokens,
        new_tokens,
        model=None,
        progress=gr.Progress(),
        request: gr.Request | None = None,
    ):
        """Every chosen preset at every concurrency level (streams submitted at once)."""

        def setup():
            levels = counts_from(levels_text, "Concurrency", "1,2,4,8")
            config = ConcurrencyConfig(
                levels=levels,
                prompt_tokens=whole(prompt_tokens),
                new_tokens=whole(new_tokens),
                presets=tuple(presets or ()),
            )
            return lambda engine, tick, cancel: run_concurrency(
                engine, config, tick, presets=self.presets, cancel=cancel
            )

        return self._measure(
            setup, model, progress, request, CONCURRENCY_COLUMNS, describe_concurrency
        )

    def _measure(self, setup, model, progress, request, columns, describe):
        """What both runs do: `setup()` checks the fields and gives the run (engine, progress,
        cancel -> result), which runs on the model held, as this session's run of BENCH (Stop
        ends it); (table, plot data, status), or (None, None, why not)."""
        try:
            run = setup()
            with self.sessions.running(request, BENCH) as cancel:
                with self.measured(model, progress) as engine:
                    result = run(engine, lambda f, m: progress(f, desc=m), cancel)
        except BenchStopped as e:
            return None, None, str(e)
        # a bad field, a level past the queue, an unknown preset, a model that cannot load
        except (*USER_ERRORS, ValueError, TypeError) as e:
            return None, None, error(user_message(e))
        return (*shown(to_dict(result)["rows"], columns), describe(result))

    def stop(self, request: gr.Request | None = None) -> str:
        """Stop: the session's benchmark ends within the run it is in (a reply streaming in
        another tab goes on)."""
        if self.sessions.stop(request, BENCH):
            return "stopping: the benchmark ends with the run it is in"
        return "nothing to stop"

    def model_note(self, model) -> str:
        """The line under the Model dropdown: empty for a local model, why not for a remote
        one (from its spec: drawing it never loads the model)."""
        try:
            name = self.models.resolve(model)
        except USER_ERRORS as e:
            return error(user_message(e))
        return f"*{remote_note(name)}.*" if self.models.specs[name].remote else ""


def build_benchmark_tab(app: TabContext, label: str) -> None:
    """The Benchmark tab and its events, under `label`; call inside the app's `gr.Blocks`. The
    app's header (the line above the tabs) is redrawn after this tab's runs."""
    bench = BenchmarkHandlers(app.models, app.presets, app.sessions)
    with gr.Tab(label):
        remote = bench.model_note(None)
        # the dropdown shows with several models; the note with a remote model
        with gr.Row(visible=len(bench.models.names) > 1 or bool(remote)):
            model = build_model_picker(bench.models)
            note = gr.Markdown(remote)
        gr.Markdown(
            "Manual decoding with and without the KV cache, and transformers' "
            "`generate()` as the reference, greedy, over several prompt lengths."
        )
        with gr.Row():
            lengths = gr.Textbox(label="Prompt lengths (tokens)", value="32,128,512")
            new_tokens = gr.Slider(minimum=2, maximum=256, value=24, step=1, label="New tokens")
            repeat = gr.Slider(minimum=1, maximum=5, value=1, step=1, label="Repeats (median)")
        with gr.Row():
            button = gr.Button("Run benchmark", variant="primary", scale=3)
            stop_button = gr.Button("Stop", variant="stop", scale=1, elem_id="bench-stop")
        status = gr.Markdown()
        table = gr.Dataframe(
            empty_table(BENCH_COLUMNS), label="Results", interactive=False, elem_id="bench-table"
        )
        plot = Trend(
            x="prompt_tokens",
            y="decode_tokens_per_s",
            color="mode",
            title="Decode tokens/s by prompt length",
            x_title="prompt tokens",
            x_axis_format="~g",  # 1, not "1.000000" (one x alone), and 1.5 where ticks fall
            y_title="decode tokens/s",
        )

        gr.Markdown(
            "### Concurrency\nSeveral streams submitted at once, each with its own "
            "prompt and seed: all streams' tokens per second of wall time (aggregate), "
            "one stream's own rate, time to first token, the gaps between tokens, and "
            "the share of the ceiling measured on this machine in the same run."
        )
        with gr.Row():
            levels = gr.Textbox(
                label="Concurrency levels (streams at once)", value="1,2,4,8", placeholder="1,2,4,8"
            )
            chosen = gr.Dropdown(
                choices=bench.preset_names,
                multiselect=True,
                value=[n for n in CONCURRENCY_PRESETS if n in bench.preset_names],
                label="Concurrency presets",
            )
            prompt_tokens = gr.Slider(
                minimum=2, maximum=2048, value=64, step=1, label="Stream prompt tokens"
            )
            stream_tokens = gr.Slider(
                minimum=2, maximum=512, value=128, step=1, label="Stream new tokens"
            )
        with gr.Row():
            concurrency_button = gr.Button("Run concurrency benchmark", variant="primary", scale=3)
            concurrency_stop = gr.Button("Stop", variant="stop", scale=1)
        concurrency_status = gr.Markdown()
        concurrency_table = gr.Dataframe(
            empty_table(CONCURRENCY_COLUMNS),
            label="Concurrency results",
            interactive=False,
            elem_id="concurrency-table",
        )
        concurrency_plot = Trend(
            x="concurrency",
            y="aggregate_tokens_per_s",
            color="preset",
            title="Aggregate tokens/s by concurrency",
            x_title="streams at once",
            x_axis_format="~g",
            y_title="aggregate tokens/s",
        )
    one_at_a_time = dict(concurrency_id=BENCHMARK_EVENTS, concurrency_limit=1)
    runs = [
        button.click(
            bench.benchmark,
            [lengths, new_tokens, repeat, model],
            [table, plot, status],
            **one_at_a_time,
        ),
        concurrency_button.click(
            bench.concurrency,
            [levels, chosen, prompt_tokens, stream_tokens, model],
            [concurrency_table, concurrency_plot, concurrency_status],
            **one_at_a_time,
        ),
    ]
    # not queued: a Stop must not wait behind the run it stops
    stop_button.click(bench.stop, None, status, queue=False)
    concurrency_stop.click(bench.stop, None, concurrency_status, queue=False)
    model.change(bench.model_note, model, note, queue=False, show_progress="hidden")
    follow_picker(bench.models, model, runs, app.demo)
    app.header.refresh_after(runs)
