import java.io.BufferedReader;
import java.io.File;
import java.io.FileOutputStream;
import java.io.InputStreamReader;
import java.io.OutputStream;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.HashMap;
import java.util.Map;
import java.util.concurrent.atomic.AtomicBoolean;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hdfs.MiniDFSCluster;
import org.apache.hadoop.yarn.conf.YarnConfiguration;
import org.apache.hadoop.yarn.server.MiniYARNCluster;

/**
 * HDFS (a NameNode, DataNodes, WebHDFS) and YARN (a ResourceManager, NodeManagers) in one JVM,
 * on loopback: Hadoop's own test clusters, which Spark's YARN tests use too.
 *
 * Started by rnnlm.hadoop.minicluster with the working directory --dir (MiniYARNCluster keeps
 * its files under ./target). Protocol on stdout, one line each: "ready {json}" once both are
 * up and the client configuration is written; "ok COMMAND" or "error MESSAGE" for each line
 * read on stdin. Commands: "stop-datanode I" (as a crash would: no hand-over), "restart-datanode I".
 * End of stdin, SIGINT or SIGTERM shut both down.
 * Everything Hadoop prints goes to stderr (the launcher sends it to a log file), so stdout
 * carries nothing but the protocol.
 */
public final class MiniCluster {
  private static final PrintStream PROTOCOL = System.out;

  private MiniCluster() {
  }

  public static void main(String[] args) {
    System.setOut(System.err);
    try {
      run(args);
    } catch (Throwable e) {
      // Hadoop's non-daemon threads would keep a half-started cluster alive
      e.printStackTrace();
      PROTOCOL.println("error " + e);
      PROTOCOL.flush();
      Runtime.getRuntime().halt(1);
    }
  }

  private static void run(String[] args) throws Exception {
    Map<String, String> opt = options(args);
    File dir = new File(opt.get("--dir")).getAbsoluteFile();
    int datanodes = Integer.parseInt(opt.getOrDefault("--datanodes", "2"));
    int nodemanagers = Integer.parseInt(opt.getOrDefault("--nodemanagers", "2"));
    int nmMemory = Integer.parseInt(opt.getOrDefault("--nm-memory-mb", "3072"));
    int nmVcores = Integer.parseInt(opt.getOrDefault("--nm-vcores", "2"));

    Configuration conf = new Configuration();
    conf.set(MiniDFSCluster.HDFS_MINIDFS_BASEDIR, new File(dir, "dfs").getPath());
    conf.setBoolean("dfs.webhdfs.enabled", true);
    conf.setInt("dfs.replication", Math.min(2, datanodes));
    // a stopped DataNode is declared dead in ~40 s instead of 10.5 minutes
    conf.setInt("dfs.namenode.heartbeat.recheck-interval", 5000);
    MiniDFSCluster dfs = new MiniDFSCluster.Builder(conf).numDataNodes(datanodes).build();
    dfs.waitActive();
    Configuration hdfsConf = dfs.getConfiguration(0);

    YarnConfiguration yconf = new YarnConfiguration(hdfsConf);
    yconf.setInt(YarnConfiguration.NM_PMEM_MB, nmMemory);
    yconf.setInt(YarnConfiguration.NM_VCORES, nmVcores);
    yconf.setInt(YarnConfiguration.RM_SCHEDULER_MINIMUM_ALLOCATION_MB, 128);
    yconf.setInt(YarnConfiguration.RM_SCHEDULER_MAXIMUM_ALLOCATION_MB, nmMemory);
    // a nearly full development disk must not mark every NodeManager unhealthy
    yconf.setFloat(YarnConfiguration.NM_MAX_PER_DISK_UTILIZATION_PERCENTAGE, 100.0f);
    // one queue; Hadoop's default lets ApplicationMasters take 10% of the memory, too little for one
    yconf.set("yarn.scheduler.capacity.root.queues", "default");
    yconf.set("yarn.scheduler.capacity.root.default.capacity", "100");
    yconf.set("yarn.scheduler.capacity.maximum-am-resource-percent", "0.5");
    yconf.setBoolean(YarnConfiguration.NM_PMEM_CHECK_ENABLED, false);
    yconf.setBoolean(YarnConfiguration.NM_VMEM_CHECK_ENABLED, false);
    // containers' logs go to HDFS as their application ends (what `yarn logs -applicationId` reads); kept on
    // the local disk instead, each NodeManager's stop waits ~17 s on their deletion, scheduled hours ahead
    yconf.setBoolean(YarnConfiguration.LOG_AGGREGATION_ENABLED, true);
    MiniYARNCluster yarn = new MiniYARNCluster("rnnlm", nodemanagers, 1, 1);
    yarn.init(yconf);
    yarn.start();
    if (!yarn.waitForNodeManagersToConnect(120000)) {
      throw new IllegalStateException("NodeManagers did not register with the ResourceManager in 120 s");
    }
    Configuration y = yarn.getConfig();

    AtomicBoolean stopped = new AtomicBoolean();
    Runnable shutdown = () -> {
      if (stopped.compareAndSet(false, true)) {
        try {
          yarn.stop();
        } finally {
          dfs.shutdown(true);
        }
      }
    };
    // a signal to the JVM itself; the launcher closes stdin instead, and main() stops both
    // outside a shutdown hook, where Hadoop's services cannot unregister their own hooks
    Runtime.getRuntime().addShutdownHook(new Thread(shutdown));

    File confDir = new File(dir, "conf");
    confDir.mkdirs();
    String defaultFs = hdfsConf.get("fs.defaultFS");
    String http = hdfsConf.get("dfs.namenode.http-address");
    write(new File(confDir, "core-site.xml"), "fs.defaultFS", defaultFs);
    write(new File(confDir, "hdfs-site.xml"),
          "dfs.replication", hdfsConf.get("dfs.replication"),
          "dfs.namenode.http-address", http,
          "dfs.webhdfs.enabled", "true");
    String[] rmKeys = {
      YarnConfiguration.RM_ADDRESS, YarnConfiguration.RM_SCHEDULER_ADDRESS,
      YarnConfiguration.RM_RESOURCE_TRACKER_ADDRESS, YarnConfiguration.RM_ADMIN_ADDRESS,
      YarnConfiguration.RM_WEBAPP_ADDRESS,
    };
    String[] yarnSite = new String[rmKeys.length * 2 + 4];
    for (int i = 0; i < rmKeys.length; i++) {
      yarnSite[2 * i] = rmKeys[i];
      yarnSite[2 * i + 1] = y.get(rmKeys[i]);
    }
    yarnSite[rmKeys.length * 2] = YarnConfiguration.RM_SCHEDULER_MINIMUM_ALLOCATION_MB;
    yarnSite[rmKeys.length * 2 + 1] = "128";
    yarnSite[rmKeys.length * 2 + 2] = YarnConfiguration.RM_SCHEDULER_MAXIMUM_ALLOCATION_MB;
    yarnSite[rmKeys.length * 2 + 3] = Integer.toString(nmMemory);
    write(new File(confDir, "yarn-site.xml"), yarnSite);

    PROTOCOL.println("ready {\"conf_dir\": \"" + confDir.getPath() + "\", \"fs_default\": \"" + defaultFs
        + "\", \"webhdfs\": \"http://" + http + "\", \"yarn\": \"" + y.get(YarnConfiguration.RM_ADDRESS)
        + "\", \"yarn_web\": \"http://" + y.get(YarnConfiguration.RM_WEBAPP_ADDRESS)
        + "\", \"datanodes\": " + datanodes + ", \"nodemanagers\": " + nodemanagers + "}");
    PROTOCOL.flush();

    Map<Integer, MiniDFSCluster.DataNodeProperties> stoppedDataNodes = new HashMap<>();
    BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
    for (String line = in.readLine(); line != null; line = in.readLine()) {
      String cmd = line.trim();
      try {
        String[] words = cmd.split("\\s+");
        if (words.length == 2 && words[0].equals("stop-datanode")) {
          int i = Integer.parseInt(words[1]);
          MiniDFSCluster.DataNodeProperties dn = dfs.stopDataNode(i);
          if (dn == null) {
            throw new IllegalArgumentException("no running DataNode " + i);
          }
          stoppedDataNodes.put(i, dn);
        } else if (words.length == 2 && words[0].equals("restart-datanode")) {
          MiniDFSCluster.DataNodeProperties dn = stoppedDataNodes.remove(Integer.parseInt(words[1]));
          if (dn == null) {
            throw new IllegalArgumentException("DataNode " + words[1] + " was not stopped");
          }
          dfs.restartDataNode(dn, true);   // same ports, so its blocks are found again
          dfs.waitActive();
        } else {
          throw new IllegalArgumentException("unknown command");
        }
        PROTOCOL.println("ok " + cmd);
      } catch (Exception e) {
        PROTOCOL.println("error " + cmd + ": " + e.getMessage());
      }
      PROTOCOL.flush();
    }
    shutdown.run();   // stdin closed: the launcher stops the cluster, or is gone
    System.exit(0);
  }

  private static Map<String, String> options(String[] args) {
    Map<String, String> opt = new HashMap<>();
    for (int i = 0; i + 1 < args.length; i += 2) {
      opt.put(args[i], args[i + 1]);
    }
    if (!opt.containsKey("--dir")) {
      throw new IllegalArgumentException("--dir is required");
    }
    return opt;
  }

  /** A Hadoop configuration file holding just these key, value pairs. */
  private static void write(File f, String... kv) throws Exception {
    Configuration c = new Configuration(false);
    for (int i = 0; i < kv.length; i += 2) {
      c.set(kv[i], kv[i + 1]);
    }
    File tmp = new File(f.getPath() + ".tmp");
    try (OutputStream out = new FileOutputStream(tmp)) {
      c.writeXml(out);
    }
    if (!tmp.renameTo(f)) {
      throw new IllegalStateException("cannot write " + f);
    }
  }
}
