# ACL policy of the autoscaler's workload identity (job meshserve-control, task autoscaler):
# read and scale the worker jobs, stop one allocation when a drain outlives its timeout.
#
#   nomad acl policy apply -namespace default -job meshserve-control -group autoscaler \
#     -task autoscaler meshserve-autoscaler compose/nomad/autoscaler-policy.hcl
namespace "default" {
  capabilities = ["list-jobs", "read-job", "read-job-scaling", "scale-job", "alloc-lifecycle"]
}
