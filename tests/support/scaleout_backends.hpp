// The two server backends behind one small interface for the scale-out
// tests that run the same scenario on both: open a store on a namespace
// (schema / key prefix), and count executions *in the server* (a table row
// or an INCR per execution), so that counts span processes and never rely
// on any process's memory.
#pragma once

#include <atomic>
#include <cstring>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include <hiredis/hiredis.h>
#include <libpq-fe.h>

#include "keel/store/postgres.hpp"
#include "keel/store/redis.hpp"
#include "support/scaleout.hpp"

namespace keel_scaleout {

using clock_offset = std::shared_ptr<std::atomic<std::int64_t>>;

template <class Store>
struct backend;

template <>
struct backend<keel::postgres_store> {
  static constexpr const char* name = "postgres";

  static std::unique_ptr<keel::postgres_store> open(const std::string& ns, clock_offset offset = {}, int pool = 4) {
    auto s = keel::postgres_store::open({.conninfo = pg_conninfo(),
                                         .schema = ns,
                                         .pool_size = pool,
                                         .testing_clock_offset = std::move(offset)});
    if (!s.ok()) throw std::runtime_error(std::string(s.status().ToString()));
    return std::move(*s);
  }

  // Executions recorded as rows of <ns>.executions, one connection per counter.
  class counter {
   public:
    explicit counter(std::string ns) : ns_(std::move(ns)), c_(PQconnectdb(pg_conninfo().c_str())) {
      if (PQstatus(c_) != CONNECTION_OK) throw std::runtime_error(PQerrorMessage(c_));
    }
    ~counter() { PQfinish(c_); }
    counter(const counter&) = delete;
    counter& operator=(const counter&) = delete;

    void prepare() { exec("CREATE TABLE IF NOT EXISTS " + ns_ + ".executions (key text NOT NULL)"); }
    void record(const std::string& key) {
      const char* v[] = {key.c_str()};
      PGresult* r = PQexecParams(c_, ("INSERT INTO " + ns_ + ".executions VALUES ($1)").c_str(), 1, nullptr, v,
                                 nullptr, nullptr, 0);
      const bool ok = PQresultStatus(r) == PGRES_COMMAND_OK;
      PQclear(r);
      if (!ok) throw std::runtime_error("recording an execution failed");
    }
    long count(const std::string& key) {
      const char* v[] = {key.c_str()};
      PGresult* r = PQexecParams(c_, ("SELECT count(*) FROM " + ns_ + ".executions WHERE key = $1").c_str(), 1,
                                 nullptr, v, nullptr, nullptr, 0);
      const long n = PQresultStatus(r) == PGRES_TUPLES_OK ? std::stol(PQgetvalue(r, 0, 0)) : -1;
      PQclear(r);
      return n;
    }

   private:
    void exec(const std::string& sql) {
      PGresult* r = PQexec(c_, sql.c_str());
      const bool ok = PQresultStatus(r) == PGRES_COMMAND_OK;
      PQclear(r);
      if (!ok) throw std::runtime_error(sql + " failed");
    }
    std::string ns_;
    PGconn* c_;
  };
};

template <>
struct backend<keel::redis_store> {
  static constexpr const char* name = "redis";

  static std::unique_ptr<keel::redis_store> open(const std::string& ns, clock_offset offset = {}, int pool = 4) {
    auto s = keel::redis_store::open({.port = redis_port(),
                                      .key_prefix = ns + ":",
                                      .pool_size = pool,
                                      .testing_clock_offset = std::move(offset)});
    if (!s.ok()) throw std::runtime_error(std::string(s.status().ToString()));
    return std::move(*s);
  }

  // Executions counted by INCR <ns>:exec:<key>.
  class counter {
   public:
    explicit counter(std::string ns) : ns_(std::move(ns)), c_(redisConnect("127.0.0.1", redis_port())) {
      if (c_ == nullptr || c_->err) throw std::runtime_error("redis counter: cannot connect");
    }
    ~counter() { redisFree(c_); }
    counter(const counter&) = delete;
    counter& operator=(const counter&) = delete;

    void prepare() {}
    void record(const std::string& key) { (void)run("INCR", key); }
    long count(const std::string& key) { return run("GET", key); }

   private:
    long run(const char* cmd, const std::string& key) {
      const std::string k = ns_ + ":exec:" + key;
      const char* argv[] = {cmd, k.c_str()};
      const std::size_t lens[] = {std::strlen(cmd), k.size()};
      auto* r = static_cast<redisReply*>(redisCommandArgv(c_, 2, argv, lens));
      if (r == nullptr) throw std::runtime_error("redis counter: command failed");
      long n = 0;
      if (r->type == REDIS_REPLY_INTEGER) n = static_cast<long>(r->integer);
      if (r->type == REDIS_REPLY_STRING) n = std::stol(std::string(r->str, r->len));
      freeReplyObject(r);
      return n;
    }
    std::string ns_;
    redisContext* c_;
  };
};

}  // namespace keel_scaleout
