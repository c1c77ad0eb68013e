"""The cost model: a configuration's memory per device and step time, and the plan chosen from them.

Layers, bottom up: the model as the estimator sees it (`sizes`, `trained`, `model_spec`,
`module_spec`, `model_input`, `finetune`, `tensor_parallel`), the memory bill (`inputs`, `activations`,
`moments`, `estimate`, `report`, `compare`), the step time (`offload_time`, `speed`), the choice
(`candidates`, `explain`, `checkpointing`, `machine`, `auto`) and `st.shard_auto` on top (`shard_auto`).
"""
