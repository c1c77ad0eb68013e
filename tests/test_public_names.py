"""The public names of `st`, `st.data` and `st.tp`: pinned, each resolvable and each documented, so the
surface grows only on purpose (a helper other packages use is imported from its module instead)."""

import re
from pathlib import Path

import pytest

import shardtrain as st

DOCS = Path(__file__).resolve().parents[1] / "docs"
PUBLIC = {
    st: {
        "AutoPolicy", "CPUOffload", "Engine", "GradScaler", "MemoryEstimate", "MixedPrecision", "Plan",
        "SizePolicy", "Strategy", "chunked_cross_entropy", "clip_grad_norm_", "compile_blocks", "data",
        "estimate_memory", "full_state_dict", "load_checkpoint", "load_full_state_dict", "load_pretrained",
        "no_sync", "plan", "quantize_base", "save_checkpoint", "save_pretrained", "shard", "shard_auto", "tp",
    },
    st.data: {
        "DataSpec", "Encoder", "Format", "IGNORE", "Overlong", "Prepared", "StreamBatches", "StreamSource", "TrainOn",
        "WindowBatches", "chat_tokens", "detect_format", "held_out_prompts", "load_rows", "load_tokenizer",
        "prepare", "render_window", "show", "stream_rows",
    },
    st.tp: {"FLAT_NAMES", "HYBRID_NAMES", "hf_plan", "llama_plan", "plan_for"},
}  # fmt: skip
# where each namespace's names are documented, and how a name is spelled there
WHERE = {st: ("*.md", "st.{}"), st.data: ("data.md", "{}"), st.tp: ("api.md", "st.tp.{}")}


@pytest.mark.parametrize("namespace", list(PUBLIC), ids=lambda m: m.__name__)
def test_each_public_name_is_pinned_resolvable_and_documented(namespace):
    assert set(namespace.__all__) == PUBLIC[namespace]
    for name in namespace.__all__:
        assert getattr(namespace, name) is not None
    page, spelling = WHERE[namespace]
    text = "\n".join(p.read_text() for p in DOCS.glob(page))
    missing = [n for n in namespace.__all__ if not re.search(re.escape(spelling.format(n)) + r"\b", text)]
    assert missing == [], f"not in docs/{page}: {missing}"
