"""The mean logprob of sampled tokens, one request at a time against 48 at once, on the untrained tiny model.

If batched decoding drew from another distribution than the one it reports, the two means would part.
Prints one JSON line: per round (REPS, default 4) the mean over ~768 sampled tokens, then the mean of
the rounds, for "seq" (6 requests of n=8, one at a time) and "conc" (48 requests of n=1 at once).

    PYTHONPATH=src python benchmarks/sampled_logprob_mean.py
"""
import asyncio, os, sys, tempfile, json, statistics
import artrl as art
from learn_concurrent import PROMPTS  # the concurrent loop's prompts
async def main():
    with tempfile.TemporaryDirectory() as d:
        backend = art.LocalBackend(path=d, show_progress=False)
        model = art.TrainableModel(name="vow", project="p", base_model="artrl/tiny")
        await model.register(backend)
        client = model.openai_client()
        async def one(p, seed, n=1):
            c = await client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": p}],
                max_tokens=16, temperature=1.0, logprobs=True, n=n, seed=seed)
            return [t.logprob for ch in c.choices for t in ch.logprobs.content]
        res = {"seq": [], "conc": []}
        for rep in range(int(os.environ.get("REPS", 4))):
            lps = []
            for i, p in enumerate(PROMPTS):
                lps += await one(p, 7000 + rep * 100 + i, n=8)
            res["seq"].append(statistics.mean(lps))
            outs = await asyncio.gather(*[one(p, 9000 + rep * 100 + i * 10 + k) for i, p in enumerate(PROMPTS) for k in range(8)])
            res["conc"].append(statistics.mean(x for o in outs for x in o))
        print(json.dumps({k: [round(x, 3) for x in v] + [round(statistics.mean(v), 3)] for k, v in res.items()}))
        await backend.close()
asyncio.run(main())
