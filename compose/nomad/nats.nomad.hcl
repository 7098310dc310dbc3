# meshserve's NATS JetStream cluster on Nomad: three nodes on three hosts, clustered with
# each other through Nomad's service discovery, JetStream on a host volume, the accounts
# and per-service permissions of ops/nats/accounts.conf.
#
# Before the first run:
#   - each client that may run a node declares the host volume `meshserve-nats`
#     (client { host_volume "meshserve-nats" { path = "/srv/meshserve-nats" } });
#   - the passwords of the NATS users, as a Nomad variable readable by this job:
#       nomad var put nomad/jobs/meshserve-nats gateway=... router=... admission=... \
#         metering=... autoscaler=... worker=... ops=... app=... sys=... cluster=...
#     (`cluster`: the password the nodes' routes authenticate with; URL-safe characters)
#     (the same values go into nomad/jobs/meshserve-control, and the worker's into the worker
#     job's own variable, nomad/jobs/meshserve-llama-3-1-8b-instruct: see worker.nomad.hcl).
#
#   - clients cap kill_timeout with their `max_kill_timeout` (30s by default): set it above
#     this job's 45s (client { max_kill_timeout = "5m" }), or a node stopping is killed in
#     the middle of its lame-duck mode instead of handing its clients over.
#
# Run from the repository root (the job embeds ops/nats/accounts.conf):
#   nomad job run compose/nomad/nats.nomad.hcl

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

variable "nats_image" {
  type    = string
  default = "nats:2.10-alpine"
}

job "meshserve-nats" {
  datacenters = var.datacenters
  type        = "service"

  group "nats" {
    count = 3

    constraint {
      operator = "distinct_hosts"
      value    = "true"
    }

    # One node at a time: two of three keep the JetStream quorum (R3 streams) while one restarts.
    update {
      max_parallel     = 1
      min_healthy_time = "30s"
      healthy_deadline = "5m"
    }

    network {
      port "client" {
        static = 4222
      }
      port "cluster" {
        static = 6222
      }
      port "monitor" {
        static = 8222
      }
    }

    volume "jetstream" {
      type      = "host"
      source    = "meshserve-nats"
      read_only = false
    }

    service {
      name     = "meshserve-nats"
      provider = "nomad"
      port     = "client"

      check {
        name     = "jetstream"
        type     = "http"
        port     = "monitor"
        path     = "/healthz?js-enabled-only=true"
        interval = "10s"
        timeout  = "3s"
      }
    }

    service {
      name     = "meshserve-nats-cluster"
      provider = "nomad"
      port     = "cluster"
    }

    task "nats" {
      driver = "docker"

      config {
        image        = var.nats_image
        network_mode = "host"
        args         = ["-c", "/local/nats.conf"]
      }

      # Lame-duck mode: clients move to the other nodes before this one stops.
      kill_signal  = "SIGUSR2"
      kill_timeout = "45s"

      volume_mount {
        volume      = "jetstream"
        destination = "/data"
      }

      template {
        destination = "local/accounts.conf"
        data        = file("ops/nats/accounts.conf")
        change_mode = "signal"
        change_signal = "SIGHUP"
      }

      # accounts.conf reads each user's password from NATS_PASSWORD_<USER>.
      template {
        destination = "secrets/passwords.env"
        env         = true
        data        = <<-EOT
          {{ with nomadVar "nomad/jobs/meshserve-nats" -}}
          NATS_PASSWORD_GATEWAY={{ .gateway }}
          NATS_PASSWORD_ROUTER={{ .router }}
          NATS_PASSWORD_ADMISSION={{ .admission }}
          NATS_PASSWORD_METERING={{ .metering }}
          NATS_PASSWORD_AUTOSCALER={{ .autoscaler }}
          NATS_PASSWORD_WORKER={{ .worker }}
          NATS_PASSWORD_OPS={{ .ops }}
          NATS_PASSWORD_APP={{ .app }}
          NATS_PASSWORD_SYS={{ .sys }}
          NATS_CLUSTER_PASSWORD={{ .cluster }}
          {{- end }}
        EOT
      }

      template {
        destination   = "local/nats.conf"
        change_mode   = "signal"
        change_signal = "SIGHUP"
        data          = <<-EOT
          server_name: "meshserve-nats-{{ env "NOMAD_ALLOC_INDEX" }}"
          listen: "0.0.0.0:4222"
          http_port: 8222
          max_payload: 8388608
          max_pending: 67108864
          lame_duck_duration: "30s"
          lame_duck_grace_period: "5s"
          jetstream {
            store_dir: "/data/jetstream"
            max_memory_store: 4294967296
            max_file_store: 107374182400
          }
          # Routes authenticate: a server that reaches port 6222 without the cluster
          # password cannot join and read every stream.
          cluster {
            name: "meshserve"
            listen: "0.0.0.0:6222"
            authorization {
              user: "route"
              password: $NATS_CLUSTER_PASSWORD
            }
            routes: [
          {{- range nomadService "meshserve-nats-cluster" }}
              "nats-route://route:{{ with nomadVar "nomad/jobs/meshserve-nats" }}{{ .cluster }}{{ end }}@{{ .Address }}:{{ .Port }}"
          {{- end }}
            ]
          }
          include ./accounts.conf
        EOT
      }

      resources {
        cpu    = 2000
        memory = 4096
      }
    }
  }
}
