"""`rollout.weights.lora.pack_adapter` on a real peft model (here, where peft is
installed): the adapter's parameters in one block, in the order
`get_peft_model_state_dict` gives them, values unchanged, and training still moving them
(an optimizer made before the packing keeps its parameters)."""

import torch

from rollout.weights.lora import one_block, pack_adapter


def test_a_peft_adapter_packed_trains_and_pushes_as_one_block(tiny_model):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                           LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    before = {k: t.clone() for k, t in get_peft_model_state_dict(model).items()}
    assert one_block(list(get_peft_model_state_dict(model).values())) is None
    pack_adapter(model)
    state = get_peft_model_state_dict(model)
    assert list(state) == list(before)
    assert all(torch.equal(state[k], before[k]) for k in before)
    block = one_block(list(state.values()))
    assert block is not None and block.numel() == sum(t.numel() for t in before.values())

    ids = torch.tensor([[1, 2, 3, 4, 5]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    after = get_peft_model_state_dict(model)
    assert one_block(list(after.values())) is not None
    assert not torch.equal(torch.cat([t.reshape(-1) for t in after.values()]),
                           torch.cat([t.reshape(-1) for t in before.values()]))
