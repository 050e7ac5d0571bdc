"""Our EXAONE 4.5 text decoder (EXAONE 4.0's hybrid decoder under the multimodal checkpoint's
prefix; the vision tower and the MTP block skipped; the outer config's tie flag) equals HF
transformers' multimodal model on text-only inputs in float32."""

import pytest
import safetensors.torch
import torch
import transformers

from pagedserve.models.exaone4_5 import Exaone4_5_ForConditionalGeneration
from pagedserve.models.loader import iter_safetensors, load_model

VOCAB = 300
TEXT = dict(model_type="exaone4", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
            sliding_window=4, layer_types=["sliding_attention"] * 3 + ["full_attention"], pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, num_key_value_heads=1, patch_size=14,
              out_hidden_size=64, fullatt_block_indexes=[0], rope_parameters={"rope_type": "axial",
                                                                               "rope_theta": 10000.0})


def exaone4_5_config(tied: bool):
    return transformers.Exaone4_5_Config(text_config=dict(TEXT), vision_config=dict(VISION),
                                         image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, tie_word_embeddings=tied)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_exaone4_5_text_decoder_matches_hf_on_text(hf_pair, check_hf, prompts, tied):
    hf, model, _ = hf_pair(exaone4_5_config(tied), hf_class=transformers.Exaone4_5_ForConditionalGeneration)
    assert type(model) is Exaone4_5_ForConditionalGeneration
    assert model.model.use_rope == [True, True, True, False]
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_exaone4_5_skips_the_mtp_block(hf_pair, check_hf, prompts):
    """The released checkpoints' `mtp.*` weights (not run by HF either) are skipped at load."""
    hf, _, folder = hf_pair(exaone4_5_config(False), hf_class=transformers.Exaone4_5_ForConditionalGeneration)
    path = folder / "model.safetensors"
    state = safetensors.torch.load_file(path)
    state["mtp.fc.weight"] = torch.ones(64, 128)
    state["mtp.layers.0.mlp.up_proj.weight"] = torch.ones(128, 64)
    safetensors.torch.save_file(state, path, metadata={"format": "pt"})
    model = load_model(transformers.AutoConfig.from_pretrained(folder), weights=iter_safetensors(folder),
                       dtype=torch.float32)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5)))
