"""The Benchmark tab: no-cache vs KV cache vs `generate()` over several prompt lengths, and
several streams at once (concurrency); the same code as `python -m miniserve bench`."""

from __future__ import annotations

import gradio as gr
import pandas as pd

from miniserve.bench import (GREEDY, BenchConfig, ConcurrencyConfig, describe_concurrency,
                             describe_run, run_bench, run_concurrency, to_dict)
from miniserve.config import ConfigError, SamplingParams
from miniserve.engine import Engine
from miniserve.ui.common import BENCHMARK_EVENTS, counts_from, error, whole

# The concurrency table's columns, from the result's rows (the plot reads the first three).
CONCURRENCY_COLUMNS = ["preset", "concurrency", "aggregate_tokens_per_s",
                       "stream_decode_tokens_per_s", "ttft_p50_s", "ttft_p95_s", "itl_p95_s",
                       "ceiling_share", "ceiling_tokens_per_s", "produced_tokens",
                       "asked_tokens", "dtype"]
CONCURRENCY_PRESETS = (GREEDY, "balanced")


class BenchmarkHandlers:
    """The Benchmark tab's handlers over one engine. Each returns (table, plot data, status);
    on a bad value (None, None, the error)."""

    def __init__(self, engine: Engine, presets: dict[str, SamplingParams] | None = None):
        self.engine = engine
        # the app's presets (from its --presets-file), which the concurrency run uses; None:
        # the default presets.yaml
        self.presets = presets
        # what the concurrency run may name: `greedy` (built in) and the app's presets
        self.preset_names = list(dict.fromkeys([GREEDY, *(presets or {})]))

    def benchmark(self, lengths_text, new_tokens, repeat, progress=gr.Progress()):
        try:
            lengths = counts_from(lengths_text, "Prompt lengths", "32,128,512")
            config = BenchConfig(prompt_tokens=lengths, new_tokens=whole(new_tokens),
                                 repeat=whole(repeat))
        except (ConfigError, ValueError, TypeError) as e:
            return None, None, error(str(e))
        result = run_bench(self.engine, config, progress=lambda f, m: progress(f, desc=m))
        table = pd.DataFrame(to_dict(result)["rows"])
        return table, table, describe_run(result)

    def concurrency(self, levels_text, presets, prompt_tokens, new_tokens,
                    progress=gr.Progress()):
        """Every chosen preset at every concurrency level (streams submitted at once)."""
        try:
            levels = counts_from(levels_text, "Concurrency", "1,2,4,8")
            config = ConcurrencyConfig(levels=levels, prompt_tokens=whole(prompt_tokens),
                                       new_tokens=whole(new_tokens),
                                       presets=tuple(presets or ()))
            result = run_concurrency(self.engine, config,
                                     progress=lambda f, m: progress(f, desc=m),
                                     presets=self.presets)
        except (ConfigError, ValueError, TypeError) as e:  # a level past the queue, a preset
            return None, None, error(str(e))
        table = pd.DataFrame(to_dict(result)["rows"])[CONCURRENCY_COLUMNS]
        return table, table, describe_concurrency(result)


def build_benchmark_tab(bench: BenchmarkHandlers) -> None:
    """The Benchmark tab and its events; call inside the app's `gr.Blocks`."""
    with gr.Tab("Benchmark"):
        gr.Markdown("Manual decoding with and without the KV cache, and transformers' "
                    "`generate()` as the reference, greedy, over several prompt lengths.")
        with gr.Row():
            lengths = gr.Textbox(label="Prompt lengths (tokens)", value="32,128,512")
            new_tokens = gr.Slider(minimum=2, maximum=256, value=24, step=1, label="New tokens")
            repeat = gr.Slider(minimum=1, maximum=5, value=1, step=1, label="Repeats (median)")
        button = gr.Button("Run benchmark", variant="primary")
        status = gr.Markdown()
        table = gr.Dataframe(label="Results", interactive=False)
        plot = gr.LinePlot(x="prompt_tokens", y="decode_tokens_per_s", color="mode",
                           title="Decode tokens/s by prompt length",
                           x_title="prompt tokens", y_title="decode tokens/s")

        gr.Markdown("### Concurrency\nSeveral streams submitted at once, each with its own "
                    "prompt and seed: all streams' tokens per second of wall time (aggregate), "
                    "one stream's own rate, time to first token, the gaps between tokens, and "
                    "the share of the ceiling measured on this machine in the same run.")
        with gr.Row():
            levels = gr.Textbox(label="Concurrency levels (streams at once)", value="1,2,4,8",
                                placeholder="1,2,4,8")
            chosen = gr.Dropdown(choices=bench.preset_names, multiselect=True,
                                 value=[n for n in CONCURRENCY_PRESETS if n in bench.preset_names],
                                 label="Concurrency presets")
            prompt_tokens = gr.Slider(minimum=2, maximum=2048, value=64, step=1,
                                      label="Stream prompt tokens")
            stream_tokens = gr.Slider(minimum=2, maximum=512, value=128, step=1,
                                      label="Stream new tokens")
        concurrency_button = gr.Button("Run concurrency benchmark", variant="primary")
        concurrency_status = gr.Markdown()
        concurrency_table = gr.Dataframe(label="Concurrency results", interactive=False,
                                         headers=CONCURRENCY_COLUMNS,
                                         elem_id="concurrency-table")
        concurrency_plot = gr.LinePlot(x="concurrency", y="aggregate_tokens_per_s",
                                       color="preset",
                                       title="Aggregate tokens/s by concurrency",
                                       x_title="streams at once",
                                       y_title="aggregate tokens/s")
    one_at_a_time = dict(concurrency_id=BENCHMARK_EVENTS, concurrency_limit=1)
    button.click(bench.benchmark, [lengths, new_tokens, repeat], [table, plot, status],
                 **one_at_a_time)
    concurrency_button.click(bench.concurrency, [levels, chosen, prompt_tokens, stream_tokens],
                             [concurrency_table, concurrency_plot, concurrency_status],
                             **one_at_a_time)
