"""The contract's data: the request and result schemas (`schemas`), the typed errors
(`errors`), their conversion from and to plain data (`convert`), the `Sampler` protocol, and
how backends are found (`plugins`). The hooks a backend implements are `rollout.hookspecs`,
which names the kit's and the weights' types, so it stands above them."""
