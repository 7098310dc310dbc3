# meshserve's control services on Nomad: gateways, routers, admission, metering and the
# autoscaler (Nomad driver). They find NATS through Nomad's service discovery (job
# meshserve-nats) and connect as their own NATS users.
#
# Before the first run:
#   - the NATS passwords (same values as for meshserve-nats), and the ledger's database URL:
#       nomad var put nomad/jobs/meshserve-control gateway=... router=... admission=... \
#         metering=... autoscaler=... ledger_url=postgresql://meshserve:...@db.internal:5432/meshserve
#   - the autoscaler's workload identity may scale the worker jobs and stop their allocations:
#       nomad acl policy apply -namespace default -job meshserve-control -group autoscaler \
#         -task autoscaler meshserve-autoscaler compose/nomad/autoscaler-policy.hcl
#   - an OpenTelemetry collector listens for OTLP/HTTP on port 4318 of every client (for
#     example the collector as a system job); traces go there.
#   - metering's health check is a script check, which Nomad runs for Consul services only
#     (Nomad's own service discovery checks http and tcp): metering registers with Consul.
#
#   - clients cap kill_timeout with their `max_kill_timeout` (30s by default): set it above
#     the gateways' 60s and the others' 45s (client { max_kill_timeout = "5m" }), or a
#     stopping gateway is killed before its open streams end.
#
#   nomad job run compose/nomad/control.nomad.hcl

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

variable "image" {
  type    = string
  default = "meshserve:0.1.0"
}

variable "model" {
  type        = string
  default     = "meta-llama/Llama-3.1-8B-Instruct"
  description = "the pool the autoscaler scales (the workers' --model)"
}

# The region the gateways run in (DESIGN.md, Regions; "": a single-region mesh): their
# requests are placed there while it has room. In a multi-region mesh every region's
# gateways need their region's name, while admission, metering and the autoscaler run once
# for the mesh (compose/README.md, Regions).
variable "region" {
  type    = string
  default = ""
}

job "meshserve-control" {
  datacenters = var.datacenters
  type        = "service"

  update {
    max_parallel     = 1
    min_healthy_time = "10s"
    healthy_deadline = "3m"
    auto_revert      = true
  }

  group "gateway" {
    count = 2

    network {
      port "http" {
        to = 8080
      }
    }

    service {
      name     = "meshserve-gateway"
      provider = "nomad"
      port     = "http"

      check {
        type     = "http"
        port     = "http"
        path     = "/healthz"
        interval = "10s"
        timeout  = "3s"
      }
    }

    task "gateway" {
      driver = "docker"

      config {
        image   = var.image
        command = "meshserve"
        args    = ["serve", "gateway", "--host", "0.0.0.0", "--port", "8080", "--gateway-id", "gw-${NOMAD_SHORT_ALLOC_ID}"]
        ports   = ["http"]
      }

      kill_signal  = "SIGTERM"
      kill_timeout = "60s"

      env {
        MESHSERVE_REGION            = var.region
        MESHSERVE_NATS_USER         = "gateway"
        MESHSERVE_JS_REPLICAS       = "3"
        MESHSERVE_LOG_FORMAT        = "json"
        OTEL_SERVICE_NAME           = "meshserve-gateway"
        OTEL_EXPORTER_OTLP_ENDPOINT = "http://${attr.unique.network.ip-address}:4318"
      }

      # NATS servers from Nomad's service discovery; this service's NATS password.
      template {
        destination = "secrets/nats.env"
        env         = true
        data        = <<-EOT
          MESHSERVE_NATS_URL={{ range $i, $s := nomadService "meshserve-nats" }}{{ if $i }},{{ end }}nats://{{ .Address }}:{{ .Port }}{{ end }}
          {{ with nomadVar "nomad/jobs/meshserve-control" }}MESHSERVE_NATS_PASSWORD={{ .gateway }}{{ end }}
        EOT
      }

      resources {
        cpu    = 1000
        memory = 1024
      }
    }
  }

  group "router" {
    count = 2

    network {
      port "metrics" {
        to = 9101
      }
    }

    service {
      name     = "meshserve-router"
      provider = "nomad"
      port     = "metrics"

      check {
        type     = "http"
        port     = "metrics"
        path     = "/metrics"
        interval = "10s"
        timeout  = "3s"
      }
    }

    task "router" {
      driver = "docker"

      config {
        image   = var.image
        command = "meshserve"
        args    = ["serve", "router", "--metrics-port", "9101", "--metrics-host", "0.0.0.0"]
        ports   = ["metrics"]
      }

      kill_signal  = "SIGTERM"
      kill_timeout = "45s"

      env {
        MESHSERVE_NATS_USER         = "router"
        MESHSERVE_JS_REPLICAS       = "3"
        MESHSERVE_LOG_FORMAT        = "json"
        OTEL_SERVICE_NAME           = "meshserve-router"
        OTEL_EXPORTER_OTLP_ENDPOINT = "http://${attr.unique.network.ip-address}:4318"
      }

      # NATS servers from Nomad's service discovery; this service's NATS password.
      template {
        destination = "secrets/nats.env"
        env         = true
        data        = <<-EOT
          MESHSERVE_NATS_URL={{ range $i, $s := nomadService "meshserve-nats" }}{{ if $i }},{{ end }}nats://{{ .Address }}:{{ .Port }}{{ end }}
          {{ with nomadVar "nomad/jobs/meshserve-control" }}MESHSERVE_NATS_PASSWORD={{ .router }}{{ end }}
        EOT
      }

      resources {
        cpu    = 1000
        memory = 1024
      }
    }
  }

  group "admission" {
    count = 2

    network {
      port "metrics" {
        to = 9102
      }
    }

    service {
      name     = "meshserve-admission"
      provider = "nomad"
      port     = "metrics"

      check {
        type     = "http"
        port     = "metrics"
        path     = "/metrics"
        interval = "10s"
        timeout  = "3s"
      }
    }

    task "admission" {
      driver = "docker"

      config {
        image   = var.image
        command = "meshserve"
        args    = ["serve", "admission", "--metrics-port", "9102", "--metrics-host", "0.0.0.0"]
        ports   = ["metrics"]
      }

      kill_signal  = "SIGTERM"
      kill_timeout = "45s"

      env {
        MESHSERVE_NATS_USER         = "admission"
        MESHSERVE_JS_REPLICAS       = "3"
        MESHSERVE_LOG_FORMAT        = "json"
        OTEL_SERVICE_NAME           = "meshserve-admission"
        OTEL_EXPORTER_OTLP_ENDPOINT = "http://${attr.unique.network.ip-address}:4318"
      }

      # NATS servers from Nomad's service discovery; this service's NATS password.
      template {
        destination = "secrets/nats.env"
        env         = true
        data        = <<-EOT
          MESHSERVE_NATS_URL={{ range $i, $s := nomadService "meshserve-nats" }}{{ if $i }},{{ end }}nats://{{ .Address }}:{{ .Port }}{{ end }}
          {{ with nomadVar "nomad/jobs/meshserve-control" }}MESHSERVE_NATS_PASSWORD={{ .admission }}{{ end }}
        EOT
      }

      resources {
        cpu    = 1000
        memory = 1024
      }
    }
  }

  group "metering" {
    count = 1

    network {
      port "metrics" {
        to = 9104
      }
    }

    service {
      name     = "meshserve-metering"
      provider = "consul"
      port     = "metrics"

      check {
        type     = "script"
        task     = "metering"
        command  = "meshserve-healthcheck"
        interval = "30s"
        timeout  = "10s"
      }
    }

    task "metering" {
      driver = "docker"

      config {
        image   = var.image
        command = "meshserve"
        args    = ["serve", "metering", "--drain-timeout", "30", "--metrics-port", "9104", "--metrics-host", "0.0.0.0"]
        ports   = ["metrics"]
      }

      kill_signal  = "SIGTERM"
      kill_timeout = "45s"

      # The ledger's PostgreSQL URL stays in a Nomad variable, not in the job.
      template {
        destination = "secrets/ledger.env"
        env         = true
        data        = <<-EOT
          {{ with nomadVar "nomad/jobs/meshserve-control" }}MESHSERVE_LEDGER_URL={{ .ledger_url }}{{ end }}
        EOT
      }

      env {
        MESHSERVE_NATS_USER         = "metering"
        MESHSERVE_JS_REPLICAS       = "3"
        MESHSERVE_LOG_FORMAT        = "json"
        OTEL_SERVICE_NAME           = "meshserve-metering"
        OTEL_EXPORTER_OTLP_ENDPOINT = "http://${attr.unique.network.ip-address}:4318"
      }

      # NATS servers from Nomad's service discovery; this service's NATS password.
      template {
        destination = "secrets/nats.env"
        env         = true
        data        = <<-EOT
          MESHSERVE_NATS_URL={{ range $i, $s := nomadService "meshserve-nats" }}{{ if $i }},{{ end }}nats://{{ .Address }}:{{ .Port }}{{ end }}
          {{ with nomadVar "nomad/jobs/meshserve-control" }}MESHSERVE_NATS_PASSWORD={{ .metering }}{{ end }}
        EOT
      }

      resources {
        cpu    = 1000
        memory = 1024
      }
    }
  }

  group "autoscaler" {
    count = 1

    network {
      port "metrics" {
        to = 9103
      }
    }

    service {
      name     = "meshserve-autoscaler"
      provider = "nomad"
      port     = "metrics"

      check {
        type     = "http"
        port     = "metrics"
        path     = "/metrics"
        interval = "10s"
        timeout  = "3s"
      }
    }

    task "autoscaler" {
      driver = "docker"

      config {
        image   = var.image
        command = "meshserve"
        args    = ["serve", "autoscaler", "--driver", "nomad", "--pool", "${var.model}", "--nomad-addr", "http://${attr.unique.network.ip-address}:4646", "--nomad-job", "${var.model}=meshserve-llama-3-1-8b-instruct", "--nomad-group", "workers", "--min-replicas", "1", "--max-replicas", "8", "--warm-buffer", "1", "--drain-timeout", "120", "--metrics-port", "9103", "--metrics-host", "0.0.0.0"]
        ports   = ["metrics"]
      }

      kill_signal  = "SIGTERM"
      kill_timeout = "45s"

      # NOMAD_TOKEN for the Nomad API (see autoscaler-policy.hcl).
      identity {
        env = true
      }

      env {
        MESHSERVE_NATS_USER         = "autoscaler"
        MESHSERVE_JS_REPLICAS       = "3"
        MESHSERVE_LOG_FORMAT        = "json"
        OTEL_SERVICE_NAME           = "meshserve-autoscaler"
        OTEL_EXPORTER_OTLP_ENDPOINT = "http://${attr.unique.network.ip-address}:4318"
      }

      # NATS servers from Nomad's service discovery; this service's NATS password.
      template {
        destination = "secrets/nats.env"
        env         = true
        data        = <<-EOT
          MESHSERVE_NATS_URL={{ range $i, $s := nomadService "meshserve-nats" }}{{ if $i }},{{ end }}nats://{{ .Address }}:{{ .Port }}{{ end }}
          {{ with nomadVar "nomad/jobs/meshserve-control" }}MESHSERVE_NATS_PASSWORD={{ .autoscaler }}{{ end }}
        EOT
      }

      resources {
        cpu    = 1000
        memory = 1024
      }
    }
  }
}
