"""Moving KV blocks between workers, by block table.

    sending side (a prefill worker)             receiving side (a decode worker)
    source = KVSource(transfer_address=...)     transport = AutoTransport()
    add_kvtransfer_service(server, source)      transport.pull_into(
    handle = source.export(cache.kv, ids,           handle, CacheSink(cache.kv, my_ids),
                           num_tokens=n)            block_ids=missing)
    ... KVHandle = handle.to_proto() ...        ... source's ReleaseLease ...
    source.release(lease_id)

- `wire.py`: the format (fixed binary header + raw bytes per chunk, checksummed), the
  errors (`KVTransferError`, `KVChecksumError`, `LeaseNotFoundError`,
  `TransferCancelled`), reassembly.
- `sinks.py`: where pulled bytes land (`CacheSink` into a paged cache, `TensorSink`).
- `segment.py`: a staged block set in one buffer (a /dev/shm file when shared).
- `source.py`: `KVSource` (leases, staging, expiry) and the KVTransfer gRPC servicer.
- `transport.py`: `KVTransport` with `ShmTransport`, `GrpcTransport`, `AutoTransport`
  and `choose_transport`.
- `handle.py`: `ExportedKV` (the transfer part of a KVHandle) and the host id.
- `stats.py`: `TransferStats`, the plain counters of every pull (bytes, blocks,
  seconds, failures by cause) that a worker's metrics exporter reads.

May import: torch, numpy, grpc, the generated stubs, the standard library. Never
`pagedserve.common` (core or runtime), a role or the router (import-linter contract
"kvtransfer"): it moves tensors and bytes and knows nothing of requests.
"""
