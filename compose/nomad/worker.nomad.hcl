# A pool of GPU workers on Nomad: one vLLM engine per allocation, one GPU each. The
# autoscaler (job meshserve-control, --driver nomad) changes the count of the group
# `workers` of this job within its `scaling` bounds; it finds the job by
# --nomad-job MODEL=meshserve-llama-3-1-8b-instruct (or its default template
# meshserve-{pool slug}, which gives the same id for this model).
#
# Scale-down drains: the autoscaler drains the chosen worker first; an allocation Nomad stops
# gets SIGTERM, finishes its in-flight requests within --drain-timeout and exits, inside
# kill_timeout. Nomad clients cap kill_timeout with their `max_kill_timeout` (30s by
# default): set it above this job's kill_timeout on GPU clients
# (client { max_kill_timeout = "5m" }).
#
# Before the first run:
#   - GPU clients run Nomad's nvidia device plugin;
#   - the worker's NATS password (and a Hugging Face token for gated models):
#       nomad var put nomad/jobs/meshserve-llama-3-1-8b-instruct worker=... hf_token=...
#   - a host volume `hf-cache` on GPU clients keeps downloaded weights across allocations;
#     its directory must be writable by the image's user (uid 10001):
#       mkdir -p /srv/hf-cache && chown 10001:10001 /srv/hf-cache
#     (client { host_volume "hf-cache" { path = "/srv/hf-cache" } }). The control hosts need
#     no copy: workers carry their tokenizer to the gateways over NATS.
#
#   nomad job run compose/nomad/worker.nomad.hcl

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

variable "image" {
  type    = string
  default = "meshserve-worker:0.1.0"
}

variable "model" {
  type    = string
  default = "meta-llama/Llama-3.1-8B-Instruct"
}

# The region these workers run in (DESIGN.md, Regions; "": a single-region mesh). In a
# multi-region mesh, run this job once per region with its name, e.g. -var region=eu-west.
variable "region" {
  type    = string
  default = ""
}

job "meshserve-llama-3-1-8b-instruct" {
  datacenters = var.datacenters
  type        = "service"

  group "workers" {
    count = 1

    scaling {
      enabled = true
      min     = 1
      max     = 8
    }

    # A worker that crashes restarts in place; weights stay in the page cache and hf-cache.
    restart {
      attempts = 3
      interval = "30m"
      delay    = "30s"
      mode     = "delay"
    }

    # Replacement allocations during a deployment start before old ones stop draining.
    update {
      max_parallel      = 1
      min_healthy_time  = "30s"
      healthy_deadline  = "20m"
      progress_deadline = "30m"
    }

    volume "hf-cache" {
      type      = "host"
      source    = "hf-cache"
      read_only = false
    }

    network {
      port "metrics" {
        to = 9400
      }
    }

    # vLLM-compatible metrics (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, ...);
    # Prometheus finds the workers through this service.
    service {
      name     = "meshserve-worker"
      provider = "nomad"
      port     = "metrics"

      check {
        type     = "http"
        port     = "metrics"
        path     = "/metrics"
        interval = "15s"
        timeout  = "5s"

        check_restart {
          limit = 3
          grace = "15m"  # weights download and load
        }
      }
    }

    task "worker" {
      driver = "docker"

      config {
        image    = var.image
        command  = "meshserve"
        args     = ["serve", "worker", "--engine", "vllm", "--model", "${var.model}", "--worker-id", "${NOMAD_ALLOC_ID}",
                    "--max-num-seqs", "256", "--max-model-len", "8192", "--gpu-memory-utilization", "0.90",
                    "--enable-prefix-caching", "--drain-timeout", "120", "--metrics-port", "9400", "--metrics-host", "0.0.0.0"]
        ports    = ["metrics"]
        shm_size = 17179869184
      }

      # SIGTERM drains: in-flight requests finish (--drain-timeout 120 s) before the exit.
      kill_signal  = "SIGTERM"
      kill_timeout = "150s"

      volume_mount {
        volume      = "hf-cache"
        destination = "/home/meshserve/.cache/huggingface"
      }

      env {
        MESHSERVE_NATS_USER         = "worker"
        MESHSERVE_REGION            = var.region
        MESHSERVE_JS_REPLICAS       = "3"
        MESHSERVE_LOG_FORMAT        = "json"
        OTEL_SERVICE_NAME           = "meshserve-worker"
        OTEL_EXPORTER_OTLP_ENDPOINT = "http://${attr.unique.network.ip-address}:4318"
      }

      template {
        destination = "secrets/nats.env"
        env         = true
        data        = <<-EOT
          MESHSERVE_NATS_URL={{ range $i, $s := nomadService "meshserve-nats" }}{{ if $i }},{{ end }}nats://{{ .Address }}:{{ .Port }}{{ end }}
          {{ with nomadVar "nomad/jobs/meshserve-llama-3-1-8b-instruct" }}MESHSERVE_NATS_PASSWORD={{ .worker }}
          HF_TOKEN={{ .hf_token }}{{ end }}
        EOT
      }

      resources {
        cpu    = 8000
        memory = 65536

        device "nvidia/gpu" {
          count = 1
        }
      }
    }
  }
}
