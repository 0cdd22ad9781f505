"""The client side of sampling from other processes: a `Service` (one request per call)
over a backend in this process (`LocalService`), a `rollout serve` over HTTP
(`RemoteService`) or a pool of replicas (`ReplicaPool`), started here or by Ray
(`replicas`, `ray_placement`) and opened by deployment mode (`connect`); admission
control (`admission`) and patience with an overloaded server (`backoff`); and
`ServedRollout`, the `Sampler` a trainer holds over them (`served`).
"""
