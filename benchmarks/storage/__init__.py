"""The storage benchmarks: forge_ckpt's DCP writer/reader and actor files against raw transfers
and stock DCP on S3 and the local disk (`bench`, `methods`: the storage part of
`python -m benchmarks.run --parts storage`), and the S3 client comparison
(`python -m benchmarks.storage.s3_clients`, docs/s3_clients.md)."""
