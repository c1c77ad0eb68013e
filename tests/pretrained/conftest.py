import pytest

from tests.pretrained.hf_models import MODELS, save


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory):
    """kind -> a folder written by save_pretrained (see hf_models.MODELS)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    return {kind: save(kind, root / kind) for kind in MODELS}
