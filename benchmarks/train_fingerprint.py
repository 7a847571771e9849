"""Two seeded train calls through the public API: a fingerprint of what a train call does with its data.

Samples 8 replies to each of 6 prompts one request at a time (seeded, so the samples do not depend on
timing), rewards each by its share of vowel characters, and calls `model.train(groups,
TrainConfig(learning_rate=3e-2))`; twice. Prints one JSON line: the two steps' mean rewards and every
metric the two calls logged. Two commits whose lines agree train the same way on the same data
(docs/performance.md, "Did RL learn less after the model work?"). `LP=0` leaves `logprobs` out of the
requests; `CALLS=N` takes N calls.

    PYTHONPATH=src python benchmarks/train_fingerprint.py
"""
import asyncio, os, sys, tempfile, json, glob
import artrl as art
from learn_concurrent import PROMPTS, vowel_share  # the same prompts and reward as the concurrent loop
LOGPROBS = os.environ.get("LP", "1") == "1"
CALLS = int(os.environ.get("CALLS", 2))
async def main():
    with tempfile.TemporaryDirectory() as d:
        backend = art.LocalBackend(path=d, show_progress=False)
        model = art.TrainableModel(name="vow", project="p", base_model="artrl/tiny")
        await model.register(backend)
        client = model.openai_client()
        out = []
        for call in range(CALLS):
            groups = []
            for i, p in enumerate(PROMPTS):
                kw = {"logprobs": True} if LOGPROBS else {}
                c = await client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": p}],
                    max_tokens=16, temperature=1.0, n=8, seed=500 + 10 * call + i, **kw)
                groups.append(art.TrajectoryGroup([art.Trajectory(messages_and_choices=[{"role": "user", "content": p}, ch],
                    reward=vowel_share(ch.message.content)) for ch in c.choices]))
            out.append(round(sum(t.reward for g in groups for t in g.trajectories) / 48, 5))
            await model.train(groups, config=art.TrainConfig(learning_rate=3e-2))
        ms = []
        for f in glob.glob(d + "/**/history.jsonl", recursive=True):
            for line in open(f):
                m = json.loads(line)
                ms.append({k: (round(v, 6) if isinstance(v, float) else v) for k, v in m.items() if k.startswith(("loss", "train/", "data/")) and "time" not in k})
        print(json.dumps({"lp": LOGPROBS, "rewards": out, "metrics": ms}))
        await backend.close()
asyncio.run(main())
