"""Benchmark simulators: what the benchmarks put around the real system to stand for a bigger one.

Production knows nothing of them; they enter it only through the hooks it offers
(``sonar.cluster.driver.roles.Hooks``: the engine factory's ``wrap``, the retriever factory's
``wrap_backend``). One module per simulator, one for the settings, one that builds the hooks:

    config.py             SimConfig (the ``sim:`` section of a benchmark config), load_bench_config
    hooks.py              sim_hooks(sim) -> Hooks; SimEngineWrap, SimRetrieverWrap
    bench_engine.py       BenchEngine: sleeps per token instead of running the model (sim.engine=bench)
    decode_latency.py     DecodeLatencyEngine: a static engine plus long-tailed decode time; ReasoningLengths
    paced_engine.py       PacedContinuousHFEngine: the continuous engine with paced steps and held slots
    retrieval_latency.py  LatencyInjectingRetriever: a remote search cluster's lognormal latency
"""
