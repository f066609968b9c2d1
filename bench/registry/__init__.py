"""Registry benchmarks: lookups and ingest against raw Redis, the holder index, the mirror at scale, popular
prefixes, failover, the consistency soak and the fleet simulation."""
