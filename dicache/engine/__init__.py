"""The caching engine: everything between a transformer's block stack and a cache decision.

Modules, lowest first (each imports only those before it; docs/architecture.md §1):
- `policies/` (pure decisions on counters, step index and a lazy diff), `calibrators/` (pure tensor maths on stored
  residuals), `stats` (per-request counters), `block_plan` (the blocks a call will run, for observers such as the
  layerwise offloader), `reduction` (the residual diff, reduced over model-parallel processes);
- `state` (a request's and a branch's state), `session` (`CacheSession`: request and call scopes in `contextvars`);
- `adapters/` (how a pipeline's calls map to steps; it re-exports the block-stack description it rests on,
  `dicache.blocks`: a transformer's block lists and their forms, the registry of diffusers families);
- `hooks` (`BlockStackRunner` and `StackWalk`: the Fn / middle / Bn call, block by block), `install` (attaching a
  runner to modules, reversibly).

The public API on top of it is `dicache.api` (`dicache.enable`, `request`, `step`, `stats`, `disable`). Nothing here
imports a model, the server or the command line.
"""
