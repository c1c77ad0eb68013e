"""`shardtrain bench`: shardtrain against torch FSDP2, FSDP1 and DDP on identical training steps.

Layout, one concept per module:

- `spec`: what one measured run is (engine, model size, batch, sequence, precision, steps);
- `model`, `data`: the identical model initialisation and token batches every engine trains on;
- `engines`, `ideal`: one small adapter per engine, each turning a spec into (model, optimizer);
- `worker`: the per-process timing loop run under torchrun, writing one JSON result;
- `runner`: fresh torchrun processes per engine, interleaved and repeated, aggregated into rows;
- `metrics`, `results`: the MFU formula, statistics and the row records;
- `intervals`, `profile`: the profiler's step-time breakdown (compute, exposed communication,
  exposed copies, idle);
- `report`: the printed tables.
"""
