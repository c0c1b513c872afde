// A /metrics body as kvtierd writes it (docs/metrics.md): two tenants, three sessions, every
// series kvtierctl reads, plus series it ignores. Shared by the report and end-to-end tests.
#ifndef KVTIER_TESTS_TOOLS_CANNED_METRICS_H_
#define KVTIER_TESTS_TOOLS_CANNED_METRICS_H_

namespace kvtier::testing {

inline constexpr char kCannedMetrics[] =
    R"(# HELP kvtier_tenant_quota_bytes Host memory the tenant may use.
# TYPE kvtier_tenant_quota_bytes gauge
kvtier_tenant_quota_bytes{tenant="default"} 1073741824
kvtier_tenant_quota_bytes{tenant="team \"b\""} 268435456
# TYPE kvtier_tenant_used_bytes gauge
kvtier_tenant_used_bytes{tenant="default"} 268435456
kvtier_tenant_used_bytes{tenant="team \"b\""} 0
# TYPE kvtier_tenant_sessions gauge
kvtier_tenant_sessions{tenant="default",transport="shm"} 1
kvtier_tenant_sessions{tenant="default",transport="grpc"} 1
kvtier_tenant_sessions{tenant="team \"b\"",transport="shm"} 1
kvtier_tenant_sessions{tenant="team \"b\"",transport="grpc"} 0
# TYPE kvtier_tenant_refused_requests_total counter
kvtier_tenant_refused_requests_total{tenant="default"} 3
kvtier_tenant_refused_requests_total{tenant="team \"b\""} 0
# TYPE kvtier_arena_hugepage_bytes gauge
kvtier_arena_hugepage_bytes{tenant="default"} 2097152
kvtier_arena_hugepage_bytes{tenant="team \"b\""} 0
# TYPE kvtier_arena_numa_node gauge
kvtier_arena_numa_node{tenant="default"} 0
kvtier_arena_numa_node{tenant="team \"b\""} -1
# TYPE kvtier_arena_locked gauge
kvtier_arena_locked{tenant="default"} 1
kvtier_arena_locked{tenant="team \"b\""} 0
# TYPE kvtier_retrieval_steps_total counter
kvtier_retrieval_steps_total{tenant="default",session="s-1",transport="grpc"} 640
kvtier_retrieval_steps_total{tenant="default",session="s-2",transport="shm"} 0
kvtier_retrieval_steps_total{tenant="team \"b\"",session="b-1",transport="shm"} 32
# TYPE kvtier_retrieval_checked_heads_total counter
kvtier_retrieval_checked_heads_total{tenant="default",session="s-1",transport="grpc",head_class="retrieval"} 1000
kvtier_retrieval_checked_heads_total{tenant="default",session="s-1",transport="grpc",head_class="streaming"} 1000
kvtier_retrieval_checked_heads_total{tenant="team \"b\"",session="b-1",transport="shm",head_class="retrieval"} 100
# TYPE kvtier_retrieval_corrected_heads_total counter
kvtier_retrieval_corrected_heads_total{tenant="default",session="s-1",transport="grpc",head_class="retrieval"} 50
kvtier_retrieval_corrected_heads_total{tenant="default",session="s-1",transport="grpc",head_class="streaming"} 10
kvtier_retrieval_corrected_heads_total{tenant="team \"b\"",session="b-1",transport="shm",head_class="retrieval"} 0
# TYPE kvtier_retrieval_recalled_bytes_total counter
kvtier_retrieval_recalled_bytes_total{tenant="default",session="s-1",transport="grpc"} 3145728
kvtier_retrieval_recalled_bytes_total{tenant="team \"b\"",session="b-1",transport="shm"} 512
# TYPE kvtier_session_committed_pages gauge
kvtier_session_committed_pages{tenant="default",session="s-1",transport="grpc"} 120
kvtier_session_committed_pages{tenant="default",session="s-2",transport="shm"} 4
kvtier_session_committed_pages{tenant="team \"b\"",session="b-1",transport="shm"} 8
# TYPE kvtier_retrieval_resident_bytes gauge
kvtier_retrieval_resident_bytes{tenant="default",session="s-1",transport="grpc"} 1048576
# TYPE kvtier_retrieval_recall_strategy gauge
kvtier_retrieval_recall_strategy{tenant="default",session="s-1",transport="grpc",strategy="pages"} 0
kvtier_retrieval_recall_strategy{tenant="default",session="s-1",transport="grpc",strategy="streamed"} 1
kvtier_retrieval_recall_strategy{tenant="team \"b\"",session="b-1",transport="shm",strategy="pages"} 1
# TYPE kvtier_retrieval_layer_step_duration_seconds histogram
kvtier_retrieval_layer_step_duration_seconds_bucket{tenant="default",session="s-1",transport="grpc",le="0.001"} 600
kvtier_retrieval_layer_step_duration_seconds_bucket{tenant="default",session="s-1",transport="grpc",le="+Inf"} 640
kvtier_retrieval_layer_step_duration_seconds_sum{tenant="default",session="s-1",transport="grpc"} 0.32
kvtier_retrieval_layer_step_duration_seconds_count{tenant="default",session="s-1",transport="grpc"} 640
kvtier_retrieval_layer_step_duration_seconds_sum{tenant="team \"b\"",session="b-1",transport="shm"} 0
kvtier_retrieval_layer_step_duration_seconds_count{tenant="team \"b\"",session="b-1",transport="shm"} 0
# TYPE kvtier_retrieval_estimated_mass_recall summary
kvtier_retrieval_estimated_mass_recall_sum{tenant="default",session="s-1",transport="grpc"} 62.4
kvtier_retrieval_estimated_mass_recall_count{tenant="default",session="s-1",transport="grpc"} 64
kvtier_retrieval_estimated_mass_recall_sum{tenant="team \"b\"",session="b-1",transport="shm"} 0
kvtier_retrieval_estimated_mass_recall_count{tenant="team \"b\"",session="b-1",transport="shm"} 0
# TYPE kvtier_rpcs_total counter
kvtier_rpcs_total{method="Hello",code="OK"} 12 1712345678000
process_start_time_seconds 1.7e+09
)";

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_TOOLS_CANNED_METRICS_H_
