"""Does the trainer see the context each sampled turn was sampled from? (docs/token-record.md)

Twenty two-turn rollouts through the local server on the tiny model; each trajectory is
tokenized as a train call would, and its sampled tokens are scored by the trainer (same
weights, no update). Prints how many trajectories have a sampled token whose trainer logprob
differs from the sampled one by more than 1e-3 (float tolerance is ~1e-5). Counts only.

    PYTHONPATH=src python benchmarks/record_delta.py
"""
import asyncio, tempfile
import torch
import artrl as art
from artrl.preprocess.pack import pack
from artrl.preprocess.tokenize import tokenize_groups

async def rollout(model, client, i):
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": f"Question {i}?"}]
    mc = list(msgs)
    for turn in range(2):
        resp = await client.chat.completions.create(model=model.get_inference_name(), messages=msgs, max_tokens=16, temperature=1.0, logprobs=True)
        ch = resp.choices[0]
        mc.append(ch)
        msgs.append({"role": "assistant", "content": ch.message.content})
        nxt = {"role": "user", "content": f"And then {turn}?"}
        msgs.append(nxt); mc.append(nxt)
    return art.Trajectory(messages_and_choices=mc, reward=float(i % 2))

async def main():
    model = art.TrainableModel(name="x", project="p", base_model="artrl/tiny")
    backend = art.LocalBackend(path=tempfile.mkdtemp(), show_progress=False)
    await model.register(backend)
    client = model.openai_client()
    trajs = [await rollout(model, client, i) for i in range(20)]
    st = backend._runs["x"]
    bad = 0
    for t in trajs:
        tok = tokenize_groups([art.TrajectoryGroup([t, t.model_copy(update={"reward": t.reward + 1})])], st.trainer.tokenizer)
        seqs = [s for s in tok.sequences if s.trajectory_index == 0]
        packed = pack([seqs], max_length=st.trainer.max_length, share_prompts=False)
        tb = st.trainer.forward_tokens(packed.select(range(packed.num_rows)), grad=False)
        known = ~torch.isnan(tb.old_logprobs)
        d = float((tb.logprobs - tb.old_logprobs)[known].abs().max())
        bad += d > 1e-3
    print(f"{bad} of {len(trajs)} two-turn trajectories have a sampled token whose trainer logprob differs by > 1e-3")
    backend.close()
asyncio.run(main())
