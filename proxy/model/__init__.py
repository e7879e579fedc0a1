"""The cluster as the agent knows it, pure: types, the tracker of services and slices,
merge (one copy per endpoint), selection (the cluster and local sets), the immutable
DesiredState snapshot, skip records and the JSON view of a resolved port."""
