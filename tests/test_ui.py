"""The web app's handlers, called as Gradio calls them but without a browser, on the real
engine: what each tab shows for good values, and the readable error for a bad one."""

import html

import pytest

from miniserve.config import FIELDS, SamplingParams, load_presets
from miniserve.ui import BenchmarkHandlers, ChatHandlers, CompareHandlers, build_ui
from miniserve.ui.common import Sessions, plain_history, seed_from

PROMPT = "Write one sentence about a cat."


@pytest.fixture(scope="module")
def presets():
    return load_presets()


@pytest.fixture
def chat(engine, presets):
    return ChatHandlers(engine, presets)


@pytest.fixture
def compare(engine, presets):
    return CompareHandlers(engine, presets)


def sliders(chat, preset="factual", max_new_tokens=12):
    values = chat.apply_preset(preset)
    values[-1] = max_new_tokens
    return values


def last(generator):
    *_, final = generator
    return final


# -- Compare ---------------------------------------------------------------------------------

def test_compare_shows_one_column_per_chosen_preset(compare, presets):
    updates = list(compare.compare(PROMPT, ["factual", "creative"], 42, 8))
    status, *columns = updates[-1]
    assert status == "same prompt, seed 42, 2 presets as one batch"
    assert all(u[0].startswith("comparing 2 presets as one batch") for u in updates[:-1])
    assert len(columns) == len(presets)
    shown = {name: col for name, col in zip(presets, columns) if col["visible"]}
    assert list(shown) == ["factual", "creative"]
    for name, col in shown.items():
        head, *body = col["value"].split("\n\n")
        assert head.startswith(f"### {name}\n`T=")
        text, footer = "\n\n".join(body[:-1]), body[-1]
        assert text.strip(), name
        assert footer.startswith("*") and "tokens/s" in footer, footer


def test_compare_columns_show_each_chunks_own_tokens_per_s(compare, engine, monkeypatch):
    """The footer's tokens/s is the column's decode rate from its chunk's stats, as the
    engine reports it, not a rate the tab works out itself."""
    finals = []
    real = engine.compare

    def recording(*args, **kwargs):
        for col, chunk, seconds in real(*args, **kwargs):
            if chunk.done:
                finals.append(chunk.stats.decode_tokens_per_s)
            yield col, chunk, seconds

    monkeypatch.setattr(engine, "compare", recording)
    status, factual, *_ = last(compare.compare(PROMPT, ["factual"], 1, 6))
    assert len(finals) == 1 and finals[0] > 0
    assert factual["value"].endswith(f"6 tokens · {finals[0]:.1f} tokens/s · length*")


def test_compare_greedy_column_is_the_single_reply(compare, engine, presets):
    status, *columns = last(compare.compare(PROMPT, ["factual"], 3, 10))
    params = presets["factual"].replace(seed=3, max_new_tokens=10)
    alone, _ = engine.chat_text([{"role": "user", "content": PROMPT}], params)
    factual = columns[list(presets).index("factual")]["value"]
    assert factual.split("\n\n")[1] == html.escape(alone)


@pytest.mark.parametrize("prompt, chosen, seed, tokens, message", [
    ("", ["factual"], 42, 8, "type a prompt and choose at least one preset"),
    ("   ", ["factual"], 42, 8, "type a prompt and choose at least one preset"),
    (PROMPT, [], 42, 8, "type a prompt and choose at least one preset"),
    (PROMPT, None, 42, 8, "type a prompt and choose at least one preset"),
    (PROMPT, ["factual"], 1.5, 8, "&#x27;seed&#x27; must be a whole number"),
    (PROMPT, ["factual"], "abc", 8, "&#x27;seed&#x27; must be a whole number"),
    (PROMPT, ["factual"], 42, 2.5, "&#x27;max_new_tokens&#x27; must be a whole number"),
    (PROMPT, ["factual"], 42, 0, "&#x27;max_new_tokens&#x27; must be in [1, 4096]"),
])
def test_compare_bad_values_read_as_one_error(compare, presets, prompt, chosen, seed, tokens,
                                              message):
    updates = list(compare.compare(prompt, chosen, seed, tokens))
    assert len(updates) == 1
    status, *columns = updates[0]
    assert status.startswith("**Error:**") and message in status, status
    assert len(columns) == len(presets) and not any(c["visible"] for c in columns)


def test_compare_negative_seed_is_random(compare):
    status, *_ = last(compare.compare(PROMPT, ["balanced"], -1, 4))
    assert status == "same prompt, seed random, 1 preset as one batch"


# -- Chat ------------------------------------------------------------------------------------

def test_send_streams_then_shows_the_stats(chat):
    updates = list(chat.send("Name a colour.", [], "", *sliders(chat), 1, False))
    assert updates[0][2] == "generating…"
    chatbot, box, status, inspected = updates[-1]
    assert [m["role"] for m in chatbot] == ["user", "assistant"]
    assert chatbot[0]["content"] == "Name a colour." and chatbot[1]["content"].strip()
    assert box == "" and inspected == ""
    assert "prompt tokens" in status and "tokens/s" in status and "history not trimmed" in status


def test_send_with_the_inspector_returns_its_html(chat):
    *_, inspected = last(chat.send("Name a colour.", [], "", *sliders(chat, max_new_tokens=4),
                                   -1, True))
    assert "ms-tok" in inspected


def test_regenerate_repeats_a_greedy_reply(chat):
    chatbot, *_ = last(chat.send("Name a fruit.", [], "", *sliders(chat), -1, False))
    again, status, _ = last(chat.regenerate(chatbot, "", *sliders(chat), -1, False))
    assert again == chatbot and "tokens/s" in status


@pytest.mark.parametrize("message, seed, settings, error", [
    ("   ", 1, {}, "the message is empty; type something to send"),
    ("Hi", 1.5, {}, "&#x27;seed&#x27; must be a whole number"),
    ("Hi", "abc", {}, "&#x27;seed&#x27; must be a whole number"),
    ("Hi", 1, {"max_new_tokens": 2.5}, "&#x27;max_new_tokens&#x27; must be a whole number"),
    ("Hi", 1, {"temperature": 5}, "&#x27;temperature&#x27; must be in [0, 2]"),
    ("a long message " * 3000, 1, {}, "too long"),
])
def test_send_bad_values_keep_the_chat_and_the_message(chat, message, seed, settings, error):
    chatbot = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}]
    values = sliders(chat)
    for name, value in settings.items():
        values[list(FIELDS).index(name)] = value
    updates = list(chat.send(message, chatbot, "", *values, seed, False))
    shown, box, status, _ = updates[-1]
    assert status.startswith("**Error:**") and error in status, status
    assert shown == chatbot and box == message


def test_regenerate_with_nothing_to_regenerate(chat):
    assert list(chat.regenerate([], "", *sliders(chat), 1, False)) == \
        [([], "**Error:** nothing to regenerate yet", "")]


def test_stop_ends_the_reply_and_keeps_its_text(chat):
    replies = chat.send("Write a very long story about a dragon.", [], "",
                        *sliders(chat, max_new_tokens=1500), 1, False)
    for chatbot, _, status, _ in replies:
        if len(chatbot[-1]["content"].split()) >= 3:  # the reply is under way
            break
    chat.stop()  # no request: the "default" session, the one the reply runs in
    chatbot, _, status, _ = last(replies)
    assert "finish: cancelled" in status and "stopped by you" in status
    assert int(status.split(" new tokens")[0].split()[-1]) < 1500
    assert len(chatbot[-1]["content"].split()) >= 3


class Request:
    def __init__(self, session_hash):
        self.session_hash = session_hash


def test_stop_reaches_only_its_own_session():
    sessions = Sessions()
    with sessions.running(Request("a")) as a, sessions.running(Request("b")) as b:
        assert sessions.stop(Request("a"))
        assert a.is_set() and not b.is_set()
    assert not sessions.stop(Request("a"))


def test_stop_reaches_everything_a_session_runs():
    """A session's chat reply and comparison each watch an event of their own: Stop sets
    both, and one that ends takes only its own event away."""
    sessions = Sessions()
    with sessions.running(Request("a")) as reply:
        with sessions.running(Request("a")) as comparison:
            assert comparison is not reply
        assert sessions.stop(Request("a"))  # the comparison has ended; the reply still runs
        assert reply.is_set() and not comparison.is_set()
        with sessions.running(Request("a")) as again, sessions.running(Request("a")) as other:
            assert not again.is_set()  # a new run starts uncancelled
            assert sessions.stop(Request("a"))
            assert again.is_set() and other.is_set()
    assert not sessions.stop(Request("a"))


def test_stop_ends_a_reply_after_a_comparison_of_the_same_session(engine, presets):
    """Chat and Compare share the app's sessions: a comparison started (and finished) while a
    reply streams leaves the reply within Stop's reach."""
    sessions = Sessions()
    chat = ChatHandlers(engine, presets, sessions)
    compare = CompareHandlers(engine, presets, sessions)
    replies = chat.send("Write a very long story about a dragon.", [], "",
                        *sliders(chat, max_new_tokens=1500), 1, False)
    for chatbot, _, status, _ in replies:
        if len(chatbot[-1]["content"].split()) >= 3:  # the reply is under way
            break
    status, *_ = last(compare.compare(PROMPT, ["factual"], 1, 4))
    assert status.startswith("same prompt"), status
    chat.stop()  # the "default" session, which both ran in
    chatbot, _, status, _ = last(replies)
    assert "finish: cancelled" in status and "stopped by you" in status
    assert int(status.split(" new tokens")[0].split()[-1]) < 1500


def test_undo_clear_and_presets(chat, presets):
    chatbot = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert chat.undo(chatbot) == ([], "Hi", "last turn removed")
    assert chat.undo([]) == ([], "", "nothing to undo")
    assert chat.clear() == ([], "", "conversation cleared", "")
    assert chat.apply_preset("creative") == [1.0, 80, 0.98, 0.02, 1.15, 512]


def test_history_takes_content_parts_as_text():
    chatbot = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, "there"]},
               {"role": "assistant", "content": {"value": "Hello"}}, "not a message"]
    assert plain_history(chatbot) == [{"role": "user", "content": "Hi there"},
                                      {"role": "assistant", "content": "Hello"}]


@pytest.mark.parametrize("value, seed", [(None, None), ("", None), (-1, None), (-1.0, None),
                                         (7.0, 7), ("12", 12), (2**63 - 1, 2**63 - 1)])
def test_seed_box(value, seed):
    assert seed_from(value) == seed


# -- Benchmark -------------------------------------------------------------------------------

@pytest.mark.parametrize("lengths, new_tokens, repeat, message", [
    ("16,abc", 6, 1, "Prompt lengths: write whole numbers separated by commas, like 32,128,512"),
    ("", 6, 1, "Prompt lengths: write whole numbers separated by commas"),
    ("0", 6, 1, "prompt lengths must be whole numbers from 1 to 32768"),
    ("16", 1, 1, "new tokens must be from 2"),
    ("16", 6, 0, "repeat must be from 1 to 20"),
])
def test_benchmark_bad_values(engine, lengths, new_tokens, repeat, message):
    table, plot, status = BenchmarkHandlers(engine).benchmark(lengths, new_tokens, repeat)
    assert table is None and plot is None
    assert status.startswith("**Error:**") and message in status, status


def test_build_ui_lays_out_the_three_tabs(engine, presets):
    demo = build_ui(engine, presets, "no such preset")
    labels = {getattr(block, "label", None) for block in demo.blocks.values()}
    assert {"Chat", "Compare", "Benchmark", "Conversation", "Presets", "Results"} <= labels


def test_replies_of_many_browsers_run_at_once(engine, presets):
    """Gradio runs one event of a listener at a time unless told otherwise; the app lets as
    many engine events (Send, Regenerate, Compare) run at once as the engine admits, as one
    group, and the benchmarks one at a time."""
    demo = build_ui(engine, presets)
    assert demo._queue.default_concurrency_limit == engine.max_queue
    assert demo.max_threads >= engine.max_queue
    groups = {}
    for fn in demo.fns.values():
        groups.setdefault(fn.name, set()).add((fn.concurrency_id, fn.concurrency_limit))
    for name in ("send", "regenerate", "compare"):
        assert groups[name] == {("engine", "default")}, name  # the default: max_queue
    assert groups["benchmark"] == groups["concurrency"] == {("benchmark", 1)}


def test_concurrency_run_fills_the_table_and_the_plot(engine, presets):
    bench = BenchmarkHandlers(engine, presets)
    table, plot, status = bench.concurrency("1, 2", ["greedy"], 16, 4)
    assert list(table["concurrency"]) == [1, 2] and set(table["preset"]) == {"greedy"}
    assert (table["aggregate_tokens_per_s"] > 0).all()
    assert {"ttft_p50_s", "ttft_p95_s", "itl_p95_s", "ceiling_share"} <= set(table.columns)
    assert plot is table
    assert "16-token prompts" in status and not status.startswith("**Error")


@pytest.mark.parametrize("levels, chosen, message", [
    ("1,two", ["greedy"], "Concurrency: write whole numbers separated by commas, like 1,2,4,8"),
    ("  ", ["greedy"], "Concurrency: write whole numbers separated by commas"),
    ("0,2", ["greedy"], "concurrency levels must be whole numbers from 1 to 1000"),
    ("1,999", ["greedy"], "concurrency 999 is more than the engine admits at once"),
    ("1,2", [], "name at least one preset"),
    ("1,2", ["no-such-preset"], "unknown preset no-such-preset"),
])
def test_concurrency_bad_values(engine, presets, levels, chosen, message):
    table, plot, status = BenchmarkHandlers(engine, presets).concurrency(levels, chosen, 16, 4)
    assert table is None and plot is None
    assert status.startswith("**Error:**") and message in status, status


def test_concurrency_offers_greedy_and_the_apps_presets(engine, presets):
    assert BenchmarkHandlers(engine, presets).preset_names == ["greedy", *presets]


def test_concurrency_runs_the_apps_own_presets(engine):
    """The presets the app loaded (its --presets-file), not the default presets.yaml."""
    own = {"terse": SamplingParams(temperature=0, top_k=0, top_p=1.0, max_new_tokens=3)}
    bench = BenchmarkHandlers(engine, own)
    table, _, status = bench.concurrency("1", ["terse"], 16, 4)
    assert list(table["preset"]) == ["terse"] and not status.startswith("**Error"), status
    table, _, status = bench.concurrency("1", ["balanced"], 16, 4)  # only in presets.yaml
    assert table is None and "unknown preset balanced (available: terse, greedy)" in status
