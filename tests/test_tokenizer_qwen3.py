"""Tokenizer parity for Qwen3 GGUF files: a GGUF written with Qwen3's real vocabulary, merges,
added tokens and chat template (miniserve/bench/tokenizer_files.py, from the files `make
tokenizer-qwen3` puts in the cache folder), loaded as a user's file loads (load_model, weights as
stored: the tokenizer built from the file's header by loader._gguf_tokenizer, then read back from
the cache), gives the ids, text and special tokens Qwen's own tokenizer.json gives -- on 10,000+
characters of code, CJK, emoji, numbers, whitespace runs and decomposed accents (which only agree
with the NFC normalizer Qwen's tokenizer applies)."""

from __future__ import annotations

import json
import unicodedata
from types import SimpleNamespace

import pytest
import torch

from conftest import needs_native

pytestmark = needs_native  # weights as stored (the path that builds a GGUF's tokenizer itself)

PYTHON = '''\
def fibonacci(n: int) -> list[int]:
    """The first n Fibonacci numbers."""
    out, a, b = [], 0, 1
    for _ in range(n):
        out.append(a)
        a, b = b, a + b
    return out


class Matrix:
\tdef __init__(self, rows):
\t\tself.rows = [list(r) for r in rows]  # a copy

\tdef __matmul__(self, other: "Matrix") -> "Matrix":
\t\treturn Matrix([[sum(x * y for x, y in zip(r, c)) for c in zip(*other.rows)] for r in self.rows])


if __name__ == "__main__":
    print(f"{fibonacci(12)!r:>40} {3.141592653589793:.6f} {0xFF_FF:#x} {1_000_000:,}")
    data = {"key": [1, 2.5e-10, None, True], 'it\\'s': r"C:\\path\\to\\file.txt"}
    assert all(isinstance(k, str) for k in data), "keys are strings"
    lambda_ = lambda *args, **kwargs: (args, kwargs)  # noqa: E731
    print(lambda_(1, 2, three=3)); x = [i**2 for i in range(10) if i % 3 != 0]
'''

C_CODE = """\
#include <stdio.h>
#include <stdint.h>

/* Count the set bits of a 64-bit word (Kernighan). */
static inline int popcount64(uint64_t x) {
    int n = 0;
    while (x) { x &= x - 1; ++n; }
    return n;
}

int main(int argc, char **argv) {
\tuint64_t mask = 0xDEADBEEFCAFEBABEULL;
\tfor (int i = 0; i < argc; i++) {
\t\tprintf("%d: %s (%zu bytes)\\n", i, argv[i], sizeof argv[i]);
\t}
\tprintf("popcount(%#llx) = %d\\n", (unsigned long long)mask, popcount64(mask));
\treturn argc > 1 ? 0 : -1;   // done
}
"""

CJK = (
    "人工智能是计算机科学的一个分支，它企图了解智能的实质，并生产出一种新的能以人类智能相似的方式"
    "做出反应的智能机器。该领域的研究包括机器人、语言识别、图像识别、自然语言处理和专家系统等。"
    "今天是2024年3月15日，气温２３度，天气晴朗！《红楼梦》第一回：“满纸荒唐言，一把辛酸泪。”\n"
    "日本語の文章です。ひらがな、カタカナ、漢字が混ざっています。東京都渋谷区で会議があります。"
    "ﾊﾝｶｸｶﾀｶﾅもあります。「こんにちは」と彼は言った。ＡＢＣ１２３。\n"
    "한국어 문장입니다. 대한민국의 수도는 서울입니다. 오늘 날씨가 정말 좋네요! "
    "인공지능 기술은 빠르게 발전하고 있습니다.\n"
    "机器学习（Machine Learning）是实现人工智能的一种途径，深度学习则是机器学习的一个子领域。"
    "模型的参数量从几百万增长到上千亿，训练数据也从GB级增长到TB级。繁體中文：這是一個測試，"
    "請確認所有的字符都能被正確地編碼與解碼。\n"
    "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。"
    "彼女はコーヒーを飲みながら、ノートパソコンでプログラムを書いていた。\n"
    "서울특별시 종로구 세종대로 175. 가나다라마바사 아자차카타파하. 뷁 똠방각하 쓿 쌰.\n"
)

EMOJI = (
    "Emoji: 😀😃😄 👍🏽 👋🏿 ❤️ ✅ ⭐ 🚀🔥 "
    "ZWJ: 👨\u200d👩\u200d👧\u200d👦 👩\u200d💻 🧑\u200d🤝\u200d🧑 🏳️\u200d🌈 👁️\u200d🗨️ "
    "flags: 🇫🇷 🇯🇵 🇺🇸🇬🇧🇩🇪 🇨🇳 "
    "keycaps: 1\ufe0f\u20e3 #\ufe0f\u20e3 "
    "tag flag: 🏴\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f "
    "skin tones in a row: 👍🏻👍🏼👍🏽👍🏾👍🏿 and text after.\n"
)

NUMBERS = (
    "Numbers: 0 7 42 1234 98765 3141592653589793238462643383279502884197 "
    "12,345,678.90 -0.000001 6.022e23 1e-10 0x7fffffff 0b101010 +1 (555) 123-4567 "
    "2024-03-15T12:34:56.789Z v1.2.3 192.168.0.1:8080 100% 99.9th 1st 2nd 3rd "
    "１２３４５ ٠١٢٣٤٥٦٧٨٩ ²³¹ ½ ¾ Ⅻ 10⁻⁹\n"
)

WHITESPACE = (
    "spaces:    four,        eight,                sixteen.\n"
    "\ttab\t\ttwo tabs\t\t\tthree\n"
    "  \t mixed \t  \t\n\n\n"
    "trailing spaces   \n   leading spaces\n"
    "windows line\r\nends\r\n\r\n"
    "    \n        \n"
    " \u00a0non-breaking\u00a0space \u3000ideographic space\u2009thin\n"
)

DECOMPOSED = (
    "Decomposed: cafe\u0301 re\u0301sume\u0301 A\u030angstro\u0308m nin\u0303o "
    "fac\u0327ade u\u0308ber Ü. "
    "Vietnamese: Tie\u0302\u0301ng Vie\u0323\u0302t co\u0301 nhie\u0302\u0300u da\u0302\u0301u. "
    "Composed: café résumé Ångström niño façade über Tiếng Việt. "
    "Signs: \u212b (angstrom sign) \u2126 (ohm sign) \u212a (kelvin sign). "
    "Hangul jamo: \u1100\u1161\u11a8 \u1112\u1161\u11ab\u1100\u1173\u11af. "
    "Greek: \u03b1\u0301 \u03bf\u0313\u0301. "
    "Stacked: e\u0301\u0302 o\u0323\u0302 a\u0328\u0301.\n"
)

SCRIPTS = (
    "Русский текст: Съешь же ещё этих мягких французских булок, да выпей чаю. "
    "Ελληνικά: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. "
    "العربية: مرحبا بالعالم، كيف حالك؟ "
    "עברית: שלום עולם. "
    "हिन्दी: नमस्ते दुनिया, यह एक परीक्षण है। "
    "ไทย: สวัสดีชาวโลก "
    "Tiếng Việt: Xin chào thế giới.\n"
)

PROSE = (
    "I'm sure they'll say it's fine -- DON'T you think? We've seen 'quotes' and \"double\" ones. "
    "Visit https://example.com/path?q=1&x=%20y#frag or mail me@example.org. "
    '{"name": "test", "values": [1, 2, 3], "nested": {"ok": true}} '
    "## Markdown *bold* _it_ `code` [link](http://x.y) | table | row |\n"
    "---\n> quote\n- item\n1. first\n"
)

CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat's the weather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nThe user asks about the weather; call the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n18°C, cloudy\n</tool_response><|im_end|>\n"
    "<|endoftext|>"
)

MORE_CODE = """\
// JavaScript
const total = items.reduce((sum, { price, qty = 1 }) => sum + price * qty, 0);
export async function load(url) { const r = await fetch(`${url}?t=${Date.now()}`); return r; }

-- SQL
SELECT u.id, COUNT(*) AS n FROM users u JOIN orders o ON o.user_id = u.id
WHERE o.created_at >= '2024-01-01' GROUP BY u.id HAVING COUNT(*) > 10 ORDER BY n DESC;

# shell
for f in *.gguf; do sha256sum "$f" | cut -c1-16; done 2>/dev/null && echo "ok" || exit 1

<!-- HTML -->
<div class="card" data-id="42"><p>Hello &amp; welcome &mdash; <b>bold</b></p></div>

fn main() { let v: Vec<u32> = (1..=10).filter(|x| x % 2 == 0).collect(); println!("{v:?}"); }
"""

MATH = (
    "Math: \\int_0^\\infty e^{-x^2} dx = \\frac{\\sqrt{\\pi}}{2}; ∀x∈ℝ, x² ≥ 0; "
    "∑ᵢ aᵢ ≤ ∏ⱼ bⱼ; α+β≠γ; f′(x) → ∞; ⌊x⌋ ⊆ ∅ ∪ {∞}; A ⇒ B ⇔ ¬A ∨ B; 5 × 3 ÷ 2 ± 0.5 ≈ 7.5\n"
)

# composed text, taken apart to NFD below (Hangul syllables into jamo, accents into marks)
COMPOSED_PROSE = (
    "Le cœur a ses raisons que la raison ne connaît point. Où est l'hôtel ? À bientôt, "
    "chère Zoë ; déjà vu, naïve, Noël, façade, crème brûlée. "
    "Größere Übungen wären schön, Fräulein Müller. "
    "Tiếng Việt có nhiều dấu: người, được, những, trường học, phở bò. "
    "Señor Muñoz comió jalapeños en São Paulo. Ærøskøbing ligger på Ærø. "
    "Čeština: příliš žluťoučký kůň úpěl ďábelské ódy. "
    "한국어 자모로 나뉜 글: 안녕하세요, 반갑습니다. 日本語の濁点：がぎぐげご、パピプペポ。\n"
)

SEGMENTS = [
    PYTHON,
    C_CODE,
    MORE_CODE,
    CJK,
    EMOJI,
    NUMBERS,
    WHITESPACE,
    DECOMPOSED,
    unicodedata.normalize("NFD", COMPOSED_PROSE),
    MATH,
    SCRIPTS,
    PROSE,
    CHAT,
]
SEPARATORS = ["\n", "\n\n", " ", "\t", "   ", "\r\n", " \n\t ", "\n\n\n    "]
SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]


def mixed_text() -> str:
    """Every segment in two rounds, joined by whitespace runs that differ between rounds (the
    splits at the joins differ too)."""
    parts = []
    for r in range(2):
        for i, segment in enumerate(SEGMENTS[r:] + SEGMENTS[:r]):
            parts += [segment, SEPARATORS[(i + 3 * r) % len(SEPARATORS)]]
    return "".join(parts)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Qwen3's tokenizer.json, and the tokenizer the engine builds from the GGUF (cold, in a
    fresh cache folder) and reads back from its cache (a second load): the 150k vocabulary
    parsed once for the module."""
    from tokenizers import Tokenizer

    from miniserve.bench.tokenizer_files import (
        TokenizerFilesMissing,
        qwen3_tokenizer_dir,
        write_qwen3_tokenizer_gguf,
    )
    from miniserve.runners.loader import load_model

    try:
        folder = qwen3_tokenizer_dir()
    except TokenizerFilesMissing as e:
        pytest.fail(str(e), pytrace=False)
    root = tmp_path_factory.mktemp("qwen3")
    path = write_qwen3_tokenizer_gguf(root / "tiny-qwen3-tokenizer.gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINISERVE_CACHE", str(root / "cache"))
        built = load_model(str(path), dtype="stored", progress=lambda m: None)
        cached = load_model(str(path), dtype="stored", progress=lambda m: None)
    return SimpleNamespace(
        reference=Tokenizer.from_file(str(folder / "tokenizer.json")),
        config=json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")),
        built=built,
        cached=cached,
    )


def first_difference(text: str, got: list[int], want: list[int], reference) -> str:
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    context = reference.decode(want[max(0, i - 5) : i + 5], skip_special_tokens=False)
    return f"{len(got)} ids against {len(want)}; first difference at {i}, around {context!r}"


def test_the_text_covers_what_it_claims():
    text = mixed_text()
    assert len(text) >= 10_000
    assert unicodedata.normalize("NFC", text) != text  # decomposed accents, angstrom sign, jamo
    for piece in (
        "def ",
        "#include",
        "人工智能",
        "ひらがな",
        "한국어",
        "\u200d",
        "🇫🇷",
        "\t\t",
        "    ",
    ):
        assert piece in text


def test_the_gguf_tokenizer_gives_tokenizer_json_ids_on_mixed_text(qwen3):
    """Segment by segment (a failure names the segment), then the whole text, for the
    tokenizer built from the file and the one read back from the cache."""
    text = mixed_text()
    want = qwen3.reference.encode(text, add_special_tokens=False).ids
    for loaded in (qwen3.built, qwen3.cached):
        tok = loaded.tokenizer
        for segment in SEGMENTS:
            got = tok(segment, add_special_tokens=False)["input_ids"]
            assert got == qwen3.reference.encode(segment, add_special_tokens=False).ids, segment[
                :60
            ]
        got = tok(text, add_special_tokens=False)["input_ids"]
        assert got == want, first_difference(text, got, want, qwen3.reference)


def test_decoding_gives_back_the_nfc_text(qwen3):
    """ids -> text: what tokenizer.json decodes, which is the text composed to NFC (the
    normalizer's one change)."""
    text = mixed_text()
    ids = qwen3.reference.encode(text, add_special_tokens=False).ids
    want = qwen3.reference.decode(ids, skip_special_tokens=False)
    assert want == unicodedata.normalize("NFC", text)
    for loaded in (qwen3.built, qwen3.cached):
        assert loaded.tokenizer.decode(ids, skip_special_tokens=False) == want


def test_without_nfc_the_ids_differ(qwen3):
    """The text tests the normalizer: the same tokenizer without it (as transformers' GGUF
    converter builds a qwen2 file's) gives other ids than tokenizer.json."""
    from tokenizers import Tokenizer

    backend = qwen3.built.tokenizer.backend_tokenizer
    assert "NFC" in type(backend.normalizer).__name__ or "NFC" in repr(backend.normalizer)
    bare = Tokenizer.from_str(backend.to_str())
    bare.normalizer = None
    text = mixed_text()
    assert (
        bare.encode(text, add_special_tokens=False).ids
        != qwen3.reference.encode(text, add_special_tokens=False).ids
    )


def test_special_tokens_are_single_ids_as_in_tokenizer_json(qwen3):
    for loaded in (qwen3.built, qwen3.cached):
        tok = loaded.tokenizer
        for token in SPECIAL + ["<|endoftext|>", "<tool_response>", "</tool_response>"]:
            want = qwen3.reference.token_to_id(token)
            assert want is not None, token
            assert tok.convert_tokens_to_ids(token) == want, token
            assert tok(token, add_special_tokens=False)["input_ids"] == [want], token
            assert tok(f"x{token}y", add_special_tokens=False)["input_ids"] == (
                qwen3.reference.encode(f"x{token}y", add_special_tokens=False).ids
            )
        im_end = qwen3.reference.token_to_id("<|im_end|>")
        assert tok.eos_token_id == im_end and loaded.generation_config.eos_token_id == im_end
        assert tok.pad_token_id == qwen3.reference.token_to_id("<|endoftext|>")
        assert tok("hello", add_special_tokens=True)["input_ids"] == (
            qwen3.reference.encode("hello", add_special_tokens=False).ids
        )  # no BOS added


def test_the_chat_template_is_qwen3s(qwen3):
    for loaded in (qwen3.built, qwen3.cached):
        tok = loaded.tokenizer
        assert tok.chat_template == qwen3.config["chat_template"]
        text = tok.apply_chat_template(
            [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
        )
        assert text.startswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_the_tiny_model_runs_as_stored(qwen3):
    """The file's weights run (the same file serves as a test model elsewhere): finite logits
    over the whole vocabulary."""
    from miniserve.runners.stored import StoredRunner

    loaded = qwen3.cached
    runner = StoredRunner(loaded.model, "float32", loaded.generation_config)
    ids = qwen3.reference.encode(CHAT, add_special_tokens=False).ids[:24]
    logits = runner.forward(torch.tensor([ids]), None, all_logits=True)
    assert logits.shape == (len(ids), 151936)
    assert torch.isfinite(logits).all()
