"""Moving weight buckets into engines in other processes: the bytes by a transport (shared
memory, a collective group), the layout as JSON over the engine's control route, one
message per bucket. Plain torch on the sending side: a trainer needs no engine installed."""
