"""The contracts: Python modules generated from ``protos/splitserve_api/v1/*.proto`` (proto
package ``splitserve.v1``) and the generator. The bottom layer: it imports nothing of ours,
and every service and the command line may import it (the engine and kernels never do)."""
