"""Rollouts on several inference replicas behind one endpoint (docs/distributed.md, "Rollouts on several replicas").

A model whose `InternalModelConfig` names replicas (`inference_replicas=N` on one device,
several `inference_gpu_ids`, or `inference_endpoints` started elsewhere) is not served by
the training process: each replica is a process of its own with its own copy of the base
model, and a router (vllm-router) in front of them is what `model.openai_client()` talks to. The client's side
(one X-Session-ID per rollout, so the router keeps a rollout's turns on one replica) is client/affinity.py.

    router.py     vllm-router, started and steered (add / remove replicas) from here
    router_main.py  runs vllm-router's launcher, ended with the program that started it
    process.py    one replica process: artrl's server, its engine, the control routes
    spawn.py      a child process: ready, output and end as events, never an orphan
    client.py     the control plane's calls to one replica (never through the router)
    control.py    ReplicaSet: every version on every replica, published when all have it
"""
