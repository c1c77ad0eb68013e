import pytest

from tests.pretrained.hf_models import BNB_MODES, MODELS, save, save_bnb


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory):
    """kind -> a folder written by save_pretrained (see hf_models.MODELS)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    return {kind: save(kind, root / kind) for kind in MODELS}


@pytest.fixture(scope="session")
def bnb_folders(tmp_path_factory):
    """ "source" (the fp32 "llama_wide" model) and mode -> that model saved quantised by bitsandbytes
    (see hf_models.save_bnb)."""
    pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    root = tmp_path_factory.mktemp("bnb")
    source = save("llama_wide", root / "source")
    return {"source": source} | {mode: save_bnb(source, root / mode, mode) for mode in BNB_MODES}
