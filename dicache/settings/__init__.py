"""Settings: every value a user sets, declared once with its rules and its words.

Modules, lowest first (each imports only those before it; docs/architecture.md §1):
- `options` (`Options` / `option(...)`: frozen pydantic models whose fields carry their command-line flag, help and
  bounds; the server's and Ray's option models derive from it);
- `catalogue` (`Setting`: a cache setting as users meet it, with its environment name, sweep name and allowed values
  in words, derived from the declarations; and the wording of a bad value);
- `sources` (the `SGLANG_CACHE_DIT_*` environment and the settings profile, read into raw values);
- `cache_config` (`CacheConfig`: each cache field declared once with its rules, validated; built from the defaults,
  a profile, the environment and per-request overrides);
- `docs` (the settings as text for people: `dicache config`'s table, `env.example`, the table of docs/settings.md);
- `profiles` (settings profiles for the commands: `--profile`, writing and describing a profile file).
"""
